"""'Did you mean ...?' for a mistyped name: the one close match, or nothing."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' (leading space) when one choice is close to `word`, else ''.

    Only the single best match is offered: a list of guesses reads like the full list again.
    """
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]}?" if close else ""
