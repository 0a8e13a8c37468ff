"""Subject-verb agreement minimal pairs from treebank sentences (a targeted syntactic evaluation, after Linzen et al.
2016 and Marvin and Linzen 2018, built from gold trees as Gulordava et al. 2018 built theirs).

Each pair is a sentence's prefix up to a finite verb whose subject is a noun before it, with the verb as written and
the verb with its number flipped: is/are, was/were, has/have, does/do, and regular present-tense verbs (rattles/
rattle). The subject is a non-coordinated NOUN or PROPN with `nsubj` (or a subtype) to the verb, or to the predicate
whose auxiliary or copula is the finite verb ("The keys *are* missing", "The keys *have* been found"); pairs where the
gold verb does not agree with the subject's Number are skipped. Attractors are the nouns of the other number between
the subject and the verb. Two baselines score the same pairs without a model: the closest noun before the verb
decides the number, or the verb is always singular. It reads any CoNLL-U file with UPOS, FEATS and lemmas
(`read_conllu`); `attnreg.analysis.agreement` scores a language model on the pairs.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> rows = [("The", "the", "DET", "DT", "_", 2, "det"), ("keys", "key", "NOUN", "NNS", "Number=Plur", 6, "nsubj"),
    ...         ("to", "to", "ADP", "IN", "_", 5, "case"), ("the", "the", "DET", "DT", "_", 5, "det"),
    ...         ("cabinet", "cabinet", "NOUN", "NN", "Number=Sing", 2, "nmod"),
    ...         ("rattle", "rattle", "VERB", "VBP", "Mood=Ind|Number=Plur|Tense=Pres|VerbForm=Fin", 0, "root")]
    >>> lines = ["\\t".join(map(str, (i, w, lemma, u, x, f, h, r, "_", "_"))) for i, (w, lemma, u, x, f, h, r)
    ...          in enumerate(rows, start=1)]
    >>> path = Path(tempfile.mkdtemp(), "pairs.conllu")
    >>> header = "# sent_id = s1\\n# text = The keys to the cabinet rattle\\n"
    >>> _ = path.write_text(header + "\\n".join(lines) + "\\n\\n")
    >>> (pair,) = minimal_pairs(path)
    >>> pair.prefix, pair.good, pair.bad, pair.plural, pair.attractors
    ('The keys to the cabinet', ' rattle', ' rattles', True, 1)
    >>> baselines([pair])["closest_noun"]["with_attractors"]      # "cabinet" is closer: wrong
    0.0
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from attnreg.syntax.trees import Sentence, read_conllu

FLIPPED = {
    "is": "are",
    "are": "is",
    "was": "were",
    "were": "was",
    "has": "have",
    "have": "has",
    "does": "do",
    "do": "does",
}
SINGULAR_FORMS = {"is", "was", "has", "does"}
NOUNS = ("NOUN", "PROPN")
FINITE_DEPENDENTS = ("aux", "cop")  # relations (subtypes folded) of a predicate's auxiliaries and copula
SPLITS = ("without_attractors", "with_attractors", "all")


@dataclass(frozen=True)
class AgreementPair:
    """One minimal pair: `prefix` (the text before the verb), the verb as written (`good`) and with its number
    flipped (`bad`), each with the whitespace that precedes it in the text; the subject's number (`plural`), the
    word indices of `subject` and `verb` (0-based), the `attractors` (nouns of the other number between them), the
    number of the noun closest before the verb (`closest_plural`, the closest-noun baseline's guess) and `where`
    the sentence came from."""

    prefix: str
    good: str
    bad: str
    plural: bool
    subject: int
    verb: int
    attractors: int
    closest_plural: bool
    where: str

    @property
    def split(self) -> str:
        """ "with_attractors" or "without_attractors"."""
        return "with_attractors" if self.attractors else "without_attractors"


def third_singular(lemma: str) -> str:
    """The regular third-person singular present of `lemma`.

    Example:
        >>> [third_singular(verb) for verb in ("rattle", "watch", "try", "go", "play")]
        ['rattles', 'watches', 'tries', 'goes', 'plays']
    """
    if lemma.endswith(("s", "sh", "ch", "x", "z", "o")):
        return lemma + "es"
    if lemma.endswith("y") and len(lemma) > 1 and lemma[-2] not in "aeiou":
        return lemma[:-1] + "ies"
    return lemma + "s"


def flip(sentence: Sentence, verb: int) -> tuple[str, bool] | None:
    """(the verb's form with its number flipped, whether the verb as written is singular), or None for a verb
    this evaluation does not flip (past tense of a regular verb, a contraction, an irregular lemma)."""
    form, lower = sentence.words[verb], sentence.words[verb].lower()
    if lower in FLIPPED:
        other, singular = FLIPPED[lower], lower in SINGULAR_FORMS
    else:
        lemma = sentence.lemmas[verb] if sentence.lemmas else "_"
        tag = sentence.xpos[verb] if sentence.xpos else "_"
        if sentence.upos[verb] != "VERB" or not lemma.isalpha() or not lemma.islower() or lemma in FLIPPED:
            return None
        if tag == "VBZ" and lower == third_singular(lemma):
            other, singular = lemma, True
        elif tag == "VBP" and lower == lemma:
            other, singular = third_singular(lemma), False
        else:
            return None
    if form[:1].isupper():
        other = other[:1].upper() + other[1:]
    return other, singular


def _number(sentence: Sentence, word: int) -> bool | None:
    """True for a plural noun, False for a singular one, None for a word that is not a noun with a Number."""
    if sentence.upos[word] not in NOUNS:
        return None
    number = sentence.feature(word, "Number")
    return {"Plur": True, "Sing": False}.get(number or "")


def sentence_pairs(sentence: Sentence) -> list[AgreementPair]:
    """The minimal pairs of one sentence (see the module docstring); none without UPOS, FEATS and lemmas."""
    if sentence.upos is None or sentence.feats is None or sentence.lemmas is None or sentence.spans is None:
        return []
    relation = [name.split(":", 1)[0] for name in sentence.relations]
    children: list[list[int]] = [[] for _ in sentence.words]
    for word, head in enumerate(sentence.heads):
        if head:
            children[head - 1].append(word)
    pairs = []
    for subject, name in enumerate(relation):
        plural = _number(sentence, subject)
        if name != "nsubj" or plural is None or any(relation[child] == "conj" for child in children[subject]):
            continue
        predicate = sentence.heads[subject] - 1
        candidates = [predicate] + [c for c in children[predicate] if relation[c] in FINITE_DEPENDENTS]
        finite = sorted(c for c in candidates if sentence.feature(c, "VerbForm") == "Fin")
        if not finite or finite[0] < subject:
            continue
        verb = finite[0]
        flipped = flip(sentence, verb)
        start, end = sentence.spans[verb]
        prefix = sentence.text[:start].rstrip()
        if flipped is None or flipped[1] == plural or sentence.text[start:end] != sentence.words[verb] or not prefix:
            continue  # a form not flipped here, a gold verb that does not agree, a contraction, nothing before it
        space = sentence.text[len(prefix) : start]
        between = [_number(sentence, word) for word in range(subject + 1, verb)]
        closest = next(number for number in reversed([plural, *between]) if number is not None)
        pairs.append(
            AgreementPair(
                prefix=prefix,
                good=space + sentence.words[verb],
                bad=space + flipped[0],
                plural=plural,
                subject=subject,
                verb=verb,
                attractors=sum(number is not None and number != plural for number in between),
                closest_plural=closest,
                where=sentence.where,
            )
        )
    return pairs


def minimal_pairs(source: str | Path | Iterable[Sentence]) -> list[AgreementPair]:
    """Every minimal pair of a CoNLL-U file (`.gz` too) or of sentences read from one (see the module docstring)."""
    sentences = read_conllu(source) if isinstance(source, str | Path) else source
    return [pair for sentence in sentences for pair in sentence_pairs(sentence)]


def baselines(pairs: Sequence[AgreementPair]) -> dict[str, dict[str, float | None]]:
    """Accuracy (0-1; None for an empty split) of the two model-free baselines on each split (`SPLITS`): the
    closest noun before the verb decides the number (`closest_noun`), or the verb is always singular.

    Example:
        >>> pair = AgreementPair("The key", " is", " are", False, 1, 2, 0, False, "s1")
        >>> baselines([pair])["always_singular"]
        {'without_attractors': 1.0, 'with_attractors': None, 'all': 1.0}
    """
    guesses = {"closest_noun": lambda pair: pair.closest_plural, "always_singular": lambda pair: False}
    out: dict[str, dict[str, float | None]] = {}
    for name, guess in guesses.items():
        out[name] = {}
        for split in SPLITS:
            chosen = [pair for pair in pairs if split in ("all", pair.split)]
            right = sum(guess(pair) == pair.plural for pair in chosen)
            out[name][split] = right / len(chosen) if chosen else None
    return out


def counts(pairs: Sequence[AgreementPair]) -> dict[str, int]:
    """Pairs per split (`SPLITS`) and per subject number.

    Example:
        >>> counts([AgreementPair("The key", " is", " are", False, 1, 2, 0, False, "s1")])
        {'without_attractors': 1, 'with_attractors': 0, 'all': 1, 'plural': 0}
    """
    out = {split: sum(split in ("all", pair.split) for pair in pairs) for split in SPLITS}
    out["plural"] = sum(pair.plural for pair in pairs)
    return out
