"""GPUlayer: a peer-to-peer, zero-config scheduler for the GPUs on a LAN."""
