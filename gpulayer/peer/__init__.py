"""The peer: the daemon on one machine that advertises its resources and runs tasks."""
