"""Where tasks run: the LAN of peers (the default) or another engine behind the same API (Ray)."""
