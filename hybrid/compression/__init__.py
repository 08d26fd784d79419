"""DP gradient communication hooks (the DDP comm-hook protocol)."""


class CompressionError(ValueError):
    """A `compression` config that names an unknown method or a bad knob: one readable line.
    `hybrid.validation.validate` reports it as a ConfigError (bad input, exit 2)."""
