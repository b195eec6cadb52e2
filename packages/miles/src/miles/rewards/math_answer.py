"""Math answer equivalence: the response's final answer against the reference, by value.

The final answer is the last ``\\boxed{...}``, else what follows the last ``####``, else the
last "answer is ..." / "Answer: ...", else the last number in the response. Two answers are
equal when they are the same number (integers, decimals, thousands separators, fractions,
``\\frac``, percent signs and ``$`` dropped; relative tolerance 1e-6), the same normalised
text, or (sympy, when installed) expressions whose difference simplifies to 0. A GSM8K-style
label (``"... #### 42"``) is reduced to what follows ``####``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

__all__ = ["extract_answer", "math_equal", "math_equivalence"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"(?:answer is|answer:|answer =)\s*(.+)", re.IGNORECASE)
_MAX_SYMPY_CHARS = 80  # sympy on long model output can take seconds; such answers compare as text


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a response (see the module docstring), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    found = _ANSWER_IS.findall(text)
    if found:
        answer = found[-1].strip().splitlines()[0].strip().rstrip(".")
        nums = _NUMBER.findall(answer)
        return nums[0] if len(nums) == 1 else answer
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _clean(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right|!|,|;)", "", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    s = re.sub(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    return s.strip().rstrip(".").strip()


def _number(s: str) -> Fraction | None:
    t = s.replace(",", "").replace(" ", "")
    m = re.fullmatch(r"\(?(-?\d+(?:\.\d+)?)\)?/\(?(-?\d+(?:\.\d+)?)\)?", t)
    try:
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den != 0 else None
        if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", t):
            return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _sympy_equal(a: str, b: str) -> bool:
    if len(a) > _MAX_SYMPY_CHARS or len(b) > _MAX_SYMPY_CHARS:
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:
        return False
    rules = (*standard_transformations, implicit_multiplication_application, convert_xor)

    def parse(text: str) -> Any:
        text = text.replace("\\sqrt", "sqrt").replace("\\pi", "pi").replace("\\cdot", "*")
        return parse_expr(text.replace("{", "(").replace("}", ")"), transformations=rules)

    try:
        return bool(sympy.simplify(parse(a) - parse(b)) == 0)
    except Exception:  # the parser raises many kinds of errors on non-expressions
        return False


def math_equal(answer: str | None, reference: Any) -> bool:
    """Whether ``answer`` equals ``reference`` by value (see the module docstring)."""
    if answer is None:
        return False
    ref = str(reference)
    if "####" in ref:
        ref = ref.rsplit("####", 1)[1]
    a, b = _clean(answer), _clean(ref)
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return abs(na - nb) <= Fraction(1, 10**6) * max(Fraction(1), abs(nb))
    if " ".join(a.split()).casefold() == " ".join(b.split()).casefold():
        return True
    return _sympy_equal(a, b)


def math_equivalence(sample: Any) -> float:
    """1.0 when the response's final answer equals the label by value, else 0.0."""
    answer = extract_answer(sample.response or "")
    ok = math_equal(answer, sample.label)
    sample.metadata["reward_info"] = {"answer": answer, "correct": ok}
    return 1.0 if ok else 0.0
