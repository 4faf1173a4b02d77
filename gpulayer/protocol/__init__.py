"""What GPUlayer's connections say, without any I/O (sans-IO, as h11): the layer below the transport.

- `messages`: the vocabulary: every message type, its TypedDict and builder, its one validator, and
  `PROTOCOL_VERSION`;
- `framing`: frames and their limits, `encode`, and the incremental `MessageReader`;
- `records`: the secure channel's record layer (AEAD records with per-direction keys and counters);
- `handshake`: HELLO, AUTH, AUTH_OK and the session keys.

The transport (`gpulayer.transport`) drives these over sockets, blocking or on the event loop.
"""
