"""The built-in agreement task: generated sentences with gold dependency trees, labelled by syntax.

Each sentence comes from a small grammar with number agreement. Its subject head noun is replaced by
`[MASK]` and the label is that noun's number (0 = singular, 1 = plural): the only evidence is the
agreement of the main verb. Other verbs (in relative clauses) agree with their own noun; those whose
number differs from the subject's are *distractor verbs*. Training uses sentences with 0 or 1 of
them and the hard test split has 2, so a model that finds the main verb by position or by counting
verbs fails there, while one that follows the tree (the subject's parent is the main verb) does not.
No download: the vocabulary is the grammar's, and `build_tokenizer` makes a word-level tokenizer for it.

Grammar (each choice drawn independently; "N" is a noun of random number, except the subject):

    S    -> [P Det N ,] Det [MASK] [PP | RC1] V Det N [RC] .   fronted PP p=0.5, object RC p=0.5,
                                                                subject: none/PP/RC1 p=0.4/0.3/0.3
    PP   -> P Det N [RC1]                                       its RC p=0.5
    RC   -> that V Det N [RC] | that Det N [RC] V               subject gap (V agrees with the noun the
                                                                clause modifies) or object gap (V agrees
                                                                with its own subject N), p=0.5 each;
                                                                nested RC p=0.3, at most 2 levels
    RC1  -> an RC that holds no other

Trees are UD-style: the main verb is the root; determiners (`det`) and prepositions (`case`) attach
to their noun, the subject (`nsubj`), object (`obj`), fronted noun (`obl`) and punctuation to the main
verb, a relative clause's verb to the noun it modifies (`acl:relcl`), "that" (`nsubj` or `obj`) and
the clause's other noun to that verb, a subject PP's noun to the subject (`nmod`).

The sentence-initial PP keeps the subject from having a fixed position, object relatives keep "the
verb after 'that'" from marking the non-main verbs, and object RCs keep the main verb from being last.

Example:
    >>> splits = make_splits(train=20, val=10, test=10, hard=5, seed=0)
    >>> example = splits["hard"][0]
    >>> example.sentence.text, example.label, example.distractors
    ('your [MASK] that my children follow follows my tables that the friends push .', 0, 2)
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> tokenizer.tokenize(example.sentence.text)[:4]
    ['your', '[MASK]', 'that', 'my']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from attnreg.syntax.trees import Sentence

LABELS = ("singular", "plural")
MASK = "[MASK]"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", MASK)
TRAIN_DISTRACTORS = (0, 1)
HARD_DISTRACTORS = (2,)


@dataclass(frozen=True)
class Grammar:
    """Words and choice probabilities of the agreement grammar (see the module docstring).

    `nouns` and `verbs` map the singular form to the plural one; determiners are number-neutral.
    `subject_modifier` gives the probabilities of (none, PP, relative clause) on the subject; a
    relative clause has an object gap with p=`object_gap`; one after the main verb holds another with
    p=`nested_relative`, up to `max_depth` levels (those on the subject side never nest).

    Example:
        >>> simple = Grammar(fronted_pp=0.0, object_relative=0.0, subject_modifier=(1.0, 0.0, 0.0))
        >>> generate_example(np.random.default_rng(0), simple).sentence.text
        'our [MASK] see their key .'
        >>> Grammar(fronted_pp=1.5)
        Traceback (most recent call last):
        ...
        ValueError: Grammar: fronted_pp must be a probability in [0, 1], got 1.5
    """

    determiners: tuple[str, ...] = ("the", "my", "your", "our", "their")
    nouns: dict[str, str] = field(
        default_factory=lambda: {
            "dog": "dogs",
            "cat": "cats",
            "key": "keys",
            "friend": "friends",
            "teacher": "teachers",
            "farmer": "farmers",
            "box": "boxes",
            "car": "cars",
            "bird": "birds",
            "painter": "painters",
            "table": "tables",
            "child": "children",
        }
    )
    verbs: dict[str, str] = field(
        default_factory=lambda: {
            "sees": "see",
            "likes": "like",
            "finds": "find",
            "knows": "know",
            "helps": "help",
            "follows": "follow",
            "watches": "watch",
            "pushes": "push",
        }
    )
    prepositions: tuple[str, ...] = ("near", "behind", "with", "under", "beside")
    fronted_pp: float = 0.5
    object_relative: float = 0.5
    subject_modifier: tuple[float, float, float] = (0.4, 0.3, 0.3)
    pp_relative: float = 0.5
    nested_relative: float = 0.3
    object_gap: float = 0.5
    max_depth: int = 2

    def __post_init__(self) -> None:
        for name in ("fronted_pp", "object_relative", "pp_relative", "nested_relative", "object_gap"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Grammar: {name} must be a probability in [0, 1], got {getattr(self, name)}")
        if len(self.subject_modifier) != 3 or not np.isclose(sum(self.subject_modifier), 1.0):
            raise ValueError(
                f"Grammar: subject_modifier must be 3 probabilities (none, PP, RC) summing to 1, "
                f"got {self.subject_modifier}"
            )
        if self.max_depth < 1:
            raise ValueError(f"Grammar: max_depth must be >= 1, got {self.max_depth}")


@dataclass(frozen=True)
class AgreementExample:
    """A sentence with its gold tree, the subject's number as `label` and its count of distractor verbs.

    Example:
        >>> example = generate(1, seed=3)[0]
        >>> example.sentence.text
        'near their painter , your [MASK] find your car that their cat helps .'
        >>> LABELS[example.label], example.distractors          # "helps" does not agree with "[MASK] find"
        ('plural', 1)
    """

    sentence: Sentence
    label: int
    distractors: int


class _Builder:
    """Words in surface order with 1-based heads; a head may be set after its dependent is added."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self.heads: list[int] = []
        self.relations: list[str] = []

    def add(self, word: str, relation: str, head: int = -1) -> int:
        self.words.append(word)
        self.heads.append(head)
        self.relations.append(relation)
        return len(self.words)

    def attach(self, word: int, head: int) -> None:
        self.heads[word - 1] = head


def _pick(rng: np.random.Generator, choices: Sequence[str]) -> str:
    return choices[int(rng.integers(len(choices)))]


def _noun(grammar: Grammar, rng: np.random.Generator, plural: int) -> str:
    singular = _pick(rng, tuple(grammar.nouns))
    return grammar.nouns[singular] if plural else singular


def _verb(grammar: Grammar, rng: np.random.Generator, plural: int) -> str:
    singular = _pick(rng, tuple(grammar.verbs))
    return grammar.verbs[singular] if plural else singular


def _noun_phrase(b: _Builder, grammar: Grammar, rng: np.random.Generator, noun: str, relation: str) -> int:
    """Det N; the determiner attaches to the noun; returns the noun's index (its head set later)."""
    determiner = b.add(_pick(rng, grammar.determiners), "det")
    noun_index = b.add(noun, relation)
    b.attach(determiner, noun_index)
    return noun_index


def _relative_clause(
    b: _Builder, grammar: Grammar, rng: np.random.Generator, antecedent: int, number: int, levels: int, verbs: list[int]
) -> None:
    """A relative clause on the noun at `antecedent` (of `number`): `that V Det N [RC]` (subject gap, V agrees
    with the antecedent) or, with p=`object_gap`, `that Det N [RC] V` (object gap, V agrees with N), holding
    at most `levels` clauses in all. Appends each relative-clause verb's number to `verbs`."""
    nested = levels > 1 and rng.random() < grammar.nested_relative
    own_number = int(rng.integers(2))
    if rng.random() < grammar.object_gap:
        that = b.add("that", "obj")
        subject = _noun_phrase(b, grammar, rng, _noun(grammar, rng, own_number), "nsubj")
        if nested:
            _relative_clause(b, grammar, rng, subject, own_number, levels - 1, verbs)
        verb = b.add(_verb(grammar, rng, own_number), "acl:relcl", head=antecedent)
        b.attach(subject, verb)
        b.attach(that, verb)
        verbs.append(own_number)
        return
    that = b.add("that", "nsubj")
    verb = b.add(_verb(grammar, rng, number), "acl:relcl", head=antecedent)
    b.attach(that, verb)
    verbs.append(number)
    obj = _noun_phrase(b, grammar, rng, _noun(grammar, rng, own_number), "obj")
    b.attach(obj, verb)
    if nested:
        _relative_clause(b, grammar, rng, obj, own_number, levels - 1, verbs)


def generate_example(
    rng: np.random.Generator, grammar: Grammar | None = None, sent_id: str = "agreement", mask: str = MASK
) -> AgreementExample:
    """One sentence of the grammar drawn with `rng`, its subject noun replaced by `mask`.

    Example:
        >>> grammar = Grammar(fronted_pp=0.0, object_relative=0.0, subject_modifier=(1.0, 0.0, 0.0))
        >>> sentence = generate_example(np.random.default_rng(0), grammar).sentence
        >>> sentence.words, sentence.heads      # the main verb "see" is the root, the subject's parent
        (('our', '[MASK]', 'see', 'their', 'key', '.'), (2, 3, 0, 5, 3, 3))
        >>> sentence.relations
        ('det', 'nsubj', 'root', 'det', 'obj', 'punct')
    """
    grammar = grammar or Grammar()
    b = _Builder()
    subject_number = int(rng.integers(2))
    to_main_verb: list[int] = []
    verbs: list[int] = []  # numbers of the relative-clause verbs
    if rng.random() < grammar.fronted_pp:
        preposition = b.add(_pick(rng, grammar.prepositions), "case")
        fronted = _noun_phrase(b, grammar, rng, _noun(grammar, rng, int(rng.integers(2))), "obl")
        b.attach(preposition, fronted)
        to_main_verb += [fronted, b.add(",", "punct")]
    subject = _noun_phrase(b, grammar, rng, mask, "nsubj")
    to_main_verb.append(subject)
    modifier = int(np.searchsorted(np.cumsum(grammar.subject_modifier), rng.random(), side="right"))
    if modifier == 1:
        preposition = b.add(_pick(rng, grammar.prepositions), "case")
        number = int(rng.integers(2))
        noun = _noun_phrase(b, grammar, rng, _noun(grammar, rng, number), "nmod")
        b.attach(preposition, noun)
        b.attach(noun, subject)
        if rng.random() < grammar.pp_relative:
            _relative_clause(b, grammar, rng, noun, number, 1, verbs)
    elif modifier == 2:
        _relative_clause(b, grammar, rng, subject, subject_number, 1, verbs)
    main_verb = b.add(_verb(grammar, rng, subject_number), "root", head=0)
    object_number = int(rng.integers(2))
    obj = _noun_phrase(b, grammar, rng, _noun(grammar, rng, object_number), "obj")
    b.attach(obj, main_verb)
    if rng.random() < grammar.object_relative:
        _relative_clause(b, grammar, rng, obj, object_number, grammar.max_depth, verbs)
    to_main_verb.append(b.add(".", "punct"))
    for word in to_main_verb:
        b.attach(word, main_verb)
    spans, position = [], 0
    for word in b.words:
        spans.append((position, position + len(word)))
        position += len(word) + 1
    sentence = Sentence(
        sent_id=sent_id,
        words=tuple(b.words),
        heads=tuple(b.heads),
        relations=tuple(b.relations),
        text=" ".join(b.words),
        source="attnreg.app.task",
        spans=tuple(spans),
    )
    distractors = sum(number != subject_number for number in verbs)
    return AgreementExample(sentence, subject_number, distractors)


def generate(
    count: int,
    seed: int = 0,
    distractors: Iterable[int] | None = None,
    grammar: Grammar | None = None,
    mask: str = MASK,
    exclude: Iterable[str] = (),
) -> list[AgreementExample]:
    """`count` distinct sentences drawn with `seed`, keeping only those whose number of distractor verbs
    is in `distractors` (None = any) and whose text is not in `exclude`.

    Example:
        >>> [e.distractors for e in generate(3, seed=1, distractors=[2])]
        [2, 2, 2]
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    wanted = None if distractors is None else set(distractors)
    rng = np.random.default_rng(seed)
    seen = set(exclude)
    examples: list[AgreementExample] = []
    draws = 0
    while len(examples) < count:
        draws += 1
        if draws > 1000 * (count + 10):
            raise ValueError(
                f"generate: after {draws} draws only {len(examples)} of {count} sentences with distractors in "
                f"{sorted(wanted)} (or not excluded); the grammar rarely or never makes them"
            )
        example = generate_example(rng, grammar, sent_id=f"agreement-{seed}-{draws}", mask=mask)
        if (wanted is None or example.distractors in wanted) and example.sentence.text not in seen:
            seen.add(example.sentence.text)
            examples.append(example)
    return examples


def make_splits(
    train: int = 500,
    val: int = 200,
    test: int = 500,
    hard: int = 500,
    seed: int = 0,
    train_distractors: Sequence[int] = TRAIN_DISTRACTORS,
    hard_distractors: Sequence[int] = HARD_DISTRACTORS,
    grammar: Grammar | None = None,
    mask: str = MASK,
) -> dict[str, list[AgreementExample]]:
    """Disjoint splits: `train`, `val` and `test` with `train_distractors` distractor verbs, `hard` with
    `hard_distractors`. No sentence text occurs in two splits.

    Example:
        >>> splits = make_splits(train=40, val=10, test=10, hard=5, seed=0)
        >>> {name: len(split) for name, split in splits.items()}
        {'train': 40, 'val': 10, 'test': 10, 'hard': 5}
        >>> sorted({example.distractors for example in splits["train"]}), splits["hard"][0].distractors
        ([0, 1], 2)
    """
    overlap = set(train_distractors) & set(hard_distractors)
    if overlap:
        raise ValueError(f"train_distractors and hard_distractors share {sorted(overlap)}; the hard split must differ")
    sizes = {"train": (train, train_distractors), "val": (val, train_distractors), "test": (test, train_distractors)}
    sizes["hard"] = (hard, hard_distractors)
    splits: dict[str, list[AgreementExample]] = {}
    taken: set[str] = set()
    for offset, (name, (count, allowed)) in enumerate(sizes.items()):
        splits[name] = generate(count, seed * 1000 + offset, allowed, grammar, mask, exclude=taken)
        taken.update(example.sentence.text for example in splits[name])
    return splits


def vocabulary(grammar: Grammar | None = None) -> list[str]:
    """Every word the grammar can produce, in a fixed order (the mask excluded).

    Example:
        >>> words = vocabulary()
        >>> len(words), words[:6], words[-2:]
        (53, ['the', 'my', 'your', 'our', 'their', 'near'], ['pushes', 'push'])
    """
    grammar = grammar or Grammar()
    words = [*grammar.determiners, *grammar.prepositions, "that", ",", "."]
    words += [form for pair in grammar.nouns.items() for form in pair]
    words += [form for pair in grammar.verbs.items() for form in pair]
    return list(dict.fromkeys(words))


def build_tokenizer(words: Iterable[str], model_max_length: int = 128) -> PreTrainedTokenizerFast:
    """A fast word-level tokenizer over `words` with BERT-style special tokens and character offsets.

    Text is split on whitespace and punctuation; unknown words become `[UNK]`; `[CLS] ... [SEP]` are
    added around each text (pairs: `[CLS] A [SEP] B [SEP]`). Ids 0-4 are `[PAD] [UNK] [CLS] [SEP] [MASK]`.

    Example:
        >>> tokenizer = build_tokenizer(["the", "dog", "sees"])
        >>> tokenizer.convert_ids_to_tokens(tokenizer("the [MASK] sees")["input_ids"])
        ['[CLS]', 'the', '[MASK]', 'sees', '[SEP]']
    """
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word in words:
        if not word or any(character.isspace() for character in word):
            raise ValueError(f"build_tokenizer: word {word!r} is empty or contains whitespace")
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token=MASK,
        model_max_length=model_max_length,
    )
