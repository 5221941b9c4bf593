"""How a measured figure prints beside its standard error: in the CLI, the Prefect tables and the
promotion registry's summaries."""

from __future__ import annotations

__all__ = ["with_error"]


def with_error(value: float, standard_error: float | None, signed: bool = False) -> str:
    """'2.226 (SE 0.043)', '+0.948 (SE 0.035)'; the bare figure where no error was measured."""
    number = f"{value:+.3f}" if signed else f"{value:.3f}"
    return number if standard_error is None else f"{number} (SE {standard_error:.3f})"
