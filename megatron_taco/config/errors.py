"""The configuration errors: one type per config family, all of them a :class:`ConfigError`.

Each message names the flag (or config key) and what is allowed; entry points turn any ConfigError into one
line at start-up.
"""

from __future__ import annotations

__all__ = ["ConfigError", "TacoConfigError", "MaplConfigError", "TrainConfigError"]


class ConfigError(ValueError):
    """An invalid flag, value or combination (the message names the flag)."""


class TacoConfigError(ConfigError):
    """An invalid --taco-* flag value or combination."""


class MaplConfigError(ConfigError):
    """An invalid --mapl-* flag value or combination."""


class TrainConfigError(ConfigError):
    """An invalid trainer flag or model-section value (parallel layout, batch sizes, schedule, model shape)."""
