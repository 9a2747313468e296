"""The `vring` command: the top of the house (it may import every package; none imports it)."""
