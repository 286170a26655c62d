"""Answer extraction and the binary reward.

A completion earns 1.0 only when it is well formatted AND correct:

- the format is exactly one ``<answer>...</answer>`` pair (more than one pair is a
  hedge, e.g. ``<answer>3</answer><answer>4</answer>``, and earns 0);
- the text inside the tags denotes the reference answer. Hugging Face's math-verify
  decides that ("\\frac{1}{2}" == "0.5", "2\\sqrt{2}" == "\\sqrt{8}", "(1,2]" != "(1,2)");
  the hand-written comparison below answers only where math-verify has no verdict: a
  side it cannot parse, an answer too long to hand to sympy, a reference in words (it
  reads "Paris" as the product p*a*r*i*s, equal to "pairs"), or math-verify missing.

Reference answers of the datasets come in other formats: GSM8K ends its solution with
``#### 42`` and MATH puts the result in ``\\boxed{...}``; the extractors for those
live here too so that every task shares one notion of "the same answer".
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# Non-greedy and DOTALL: an answer may span lines, but never swallows a second pair.
_TAG_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)
_HASH_RE = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
# Thousands separators only in proper groups, so "1,2" is not read as 12.
_GROUPED_INT_RE = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_DECIMAL_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_FRACTION_RE = re.compile(r"^([+-]?\d+)\s*/\s*([+-]?\d+)$")
_LATEX_FRAC_RE = re.compile(r"^([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}$")

# Relative tolerance for decimals that cannot be compared exactly ("0.333" vs "1/3"
# must NOT match; "2.50" vs "2.5" must), so it is tight.
_REL_TOL = 1e-9
# Longer answers go to the hand-written compare only: sympy can take seconds on them, and
# math-verify's own timeout (SIGALRM) works only in the main thread.
_MATH_VERIFY_MAX_CHARS = 200
_MATH_VERIFY_TIMEOUT_S = 2
# A reference made of words ("Paris", "no solution"): math-verify reads words as products of
# variables, so the text compare decides.
_WORDS_RE = re.compile(r"^[A-Za-z][A-Za-z .'-]*[A-Za-z.]$")


def format_instruction() -> str:
    """The sentence every prompt that expects a tagged answer ends with."""
    return "Put only the final answer between <answer> and </answer>, e.g. <answer>7</answer>."


def extract_tagged(text: str) -> str | None:
    """The stripped text inside the single ``<answer>`` pair, or None when the format is wrong.

    Wrong formats: no pair, more than one pair, or an empty answer.
    """
    found = _TAG_RE.findall(text)
    if len(found) != 1:
        return None
    inner = found[0].strip()
    return inner or None


def extract_hash_answer(text: str) -> str | None:
    """The answer after the last ``#### `` marker (GSM8K's reference format), or None."""
    found = _HASH_RE.findall(text)
    if not found:
        return None
    return found[-1].strip() or None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, or None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip() or None
    return None  # unbalanced: treat as no answer rather than guess


def _strip_wrappers(s: str) -> str:
    """Remove what never changes the value: $...$, \\text{...} units, trailing period, spaces."""
    s = s.strip()
    s = s.strip("$").strip()
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}", "", s)  # units such as \text{ cm}
    s = re.sub(r"\\(?:left|right|!|,|;|:)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    s = s.rstrip(".").strip()
    return s


def parse_number(text: str) -> Fraction | float | None:
    """The number ``text`` denotes, exactly when possible, or None when it is not a number.

    Accepts integers, decimals, scientific notation, thousands separators ("1,200"),
    fractions ("3/4", "\\frac{3}{4}") and the wrappers of ``_strip_wrappers``.
    """
    s = _strip_wrappers(text).replace(" ", "")
    if _GROUPED_INT_RE.match(s):
        s = s.replace(",", "")
    if _DECIMAL_RE.match(s):
        try:
            return Fraction(s)  # exact for "12.50"; Fraction parses exponents too
        except (ValueError, ZeroDivisionError):
            return None
    m = _FRACTION_RE.match(s)
    if m:
        num, den = int(m.group(1)), int(m.group(2))
        return Fraction(num, den) if den != 0 else None
    m = _LATEX_FRAC_RE.match(s)
    if m:
        sign, num, den = m.group(1), int(m.group(2)), int(m.group(3))
        if den == 0:
            return None
        value = Fraction(num, den)
        return -value if sign == "-" else value
    return None


def _normalise_text(s: str) -> str:
    # A whole answer in \text{...} is text, not a number with its unit: keep what it holds.
    s = re.sub(r"^\$?\\text\{(.*)\}\$?$", r"\1", s.strip())
    return re.sub(r"\s+", "", _strip_wrappers(s)).lower()


def _plain_number_as_fraction(s: str) -> str:
    """ "1e3" -> "1000", "12.50" -> "25/2": math-verify reads the e of "1e3" as Euler's number,
    so plain decimals reach it as exact integers or fractions."""
    t = s.strip().strip("$").strip().replace(" ", "")
    if _GROUPED_INT_RE.match(t):
        t = t.replace(",", "")
    if not _DECIMAL_RE.match(t):
        return s
    value = Fraction(t)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _math_verify_timeout() -> int | None:
    """math-verify's timeout uses SIGALRM, which only the main thread may set."""
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=8192)
def _math_verify_parse(text: str) -> tuple[Any, ...]:
    """math-verify's readings of ``text`` (empty when it finds none, or is not installed)."""
    try:
        from math_verify import parse
    except ImportError:
        return ()
    body = _plain_number_as_fraction(text).strip().strip("$").strip()
    return tuple(parse(f"${body}$", parsing_timeout=_math_verify_timeout()))


def math_verify_verdict(predicted: str, reference: str) -> bool | None:
    """math-verify's verdict on the pair: True, False, or None when it has none."""
    if max(len(predicted), len(reference)) > _MATH_VERIFY_MAX_CHARS or _WORDS_RE.match(reference.strip()):
        return None
    gold, pred = _math_verify_parse(reference), _math_verify_parse(predicted)
    if not gold or not pred:
        return None
    from math_verify import verify

    return bool(verify(list(gold), list(pred), timeout_seconds=_math_verify_timeout()))


def answers_match(predicted: str, reference: str) -> bool:
    """True when ``predicted`` and ``reference`` denote the same answer: math-verify's verdict,
    else the hand-written compare (`hand_answers_match`)."""
    verdict = math_verify_verdict(predicted, reference)
    return verdict if verdict is not None else hand_answers_match(predicted, reference)


def hand_answers_match(predicted: str, reference: str) -> bool:
    """The hand-written compare: numerically when both sides are numbers ("12" == "12.0",
    "1,200" == "1200", "3/4" == "0.75"), else after a light normalisation of LaTeX."""
    p, r = parse_number(predicted), parse_number(reference)
    if p is not None and r is not None:
        if p == r:
            return True
        return math.isclose(float(p), float(r), rel_tol=_REL_TOL, abs_tol=0.0)
    if p is not None or r is not None:
        return False  # a number never equals a non-number
    return _normalise_text(predicted) == _normalise_text(reference) != ""


def tagged_reward(completion: str, reference: str) -> float:
    """1.0 when the completion has one well-formed answer tag whose content matches, else 0.0."""
    inner = extract_tagged(completion)
    if inner is None:
        return 0.0
    return 1.0 if answers_match(inner, reference) else 0.0
