"""The worker: the process of the job interpreter that runs tasks (`python -m gpulayer.worker`).

One receiver (receiver.py) serves every stream that tasks come on: the peer's link, a lease's
connection (leases.py), an actor's direct connections (actors.py). It needs only what a job
interpreter has (msgpack, cloudpickle, cryptography), and imports nothing of the peer or the client.
"""
