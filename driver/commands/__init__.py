"""Command groups of the `sinkflex-rl` CLI (one module each; imports stay light)."""
