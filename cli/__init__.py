"""moe-pipe."""
