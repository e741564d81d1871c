"""The rule a synthesized rationale must meet, and the cleaning before it is checked
(docs/SYNTHESIS.md)."""

from __future__ import annotations

import re


class InvalidAnswer(ValueError):
    """An answer that does not meet the rationale rule; the message says which part."""


QUOTES = "\"'`\u201c\u201d\u2018\u2019"
LABEL = re.compile(r"^\s*(rationale|reason|answer|explanation)\s*:\s*", re.IGNORECASE)
THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
FIRST_PERSON = re.compile(r"\b(I|I'm|I'll|I've|I'd|me|my|mine|myself)\b|\b(?i:me|my|mine)\b")
SENTENCE_BREAK = re.compile(r"[.!?][\"')\]\u201d\u2019]*\s+\S")
PROFILE = re.compile(
    r"\b(profile|persona|demographics?|gender|income|salary|occupation|years old|"
    r"age[sd]? \d+|\d+[- ]year[- ]old)\b|"
    # persona framing ("As a busy parent, I ..."), not "As a result, I ..."
    r"^as an? (?!(result|matter|first|last|quick)\b)[\w -]+,",
    re.IGNORECASE,
)
LENIENT_MAX_CHARS = 300


def _strip_quotes(text: str) -> str:
    while len(text) >= 2 and text[0] in QUOTES and text[-1] in QUOTES:
        text = text[1:-1].strip()
    return text


def clean_rationale(text: str, max_words: int = 40, lenient: bool = False) -> str:
    """The rationale in ``text``, cleaned; raises :class:`InvalidAnswer` if it breaks the rule.

    Rule (strict): one line, one sentence (no ``.``/``!``/``?`` followed by more text), at most
    ``max_words`` words, a first-person word (I, I'm, me, my, ...), and nothing that looks like
    user-profile information (profile, persona, age, gender, income, occupation, or an opening
    "As a ..."). Cleaning: ``<think>`` blocks, a ``Rationale:`` label and surrounding quotes are
    removed and a final period is added. Lenient: any non-empty text, whitespace collapsed,
    cut at a word boundary to 300 characters.
    """
    text = _strip_quotes(LABEL.sub("", THINK.sub("", text or "")).strip())
    if lenient:
        text = " ".join(text.split())
        if len(text) > LENIENT_MAX_CHARS:
            text = text[:LENIENT_MAX_CHARS].rsplit(" ", 1)[0]
        if not text:
            raise InvalidAnswer("empty answer")
        return text
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise InvalidAnswer("empty answer")
    if len(lines) > 1:
        raise InvalidAnswer(f"{len(lines)} lines, expected one sentence")
    text = _strip_quotes(" ".join(lines[0].split()))
    words = len(text.split())
    if words > max_words:
        raise InvalidAnswer(f"too long ({words} words > {max_words})")
    if SENTENCE_BREAK.search(text):
        raise InvalidAnswer("more than one sentence")
    if not FIRST_PERSON.search(text):
        raise InvalidAnswer("not in the first person")
    if m := PROFILE.search(text):
        raise InvalidAnswer(f"mentions user-profile information ({m.group(0)!r})")
    return text if text[-1] in ".!?" else text + "."
