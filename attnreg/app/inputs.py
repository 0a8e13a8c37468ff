"""Checks of what a user gives the apps, before anything trains: a model folder that does not exist, and a
tokenizer with more tokens than the model has embeddings.

Example:
    >>> check_model_folder("/models/roberta-base")          # a path, not a Hugging Face Hub name
    Traceback (most recent call last):
    ...
    FileNotFoundError: model /models/roberta-base: no such folder
    >>> check_model_folder("FacebookAI/roberta-base")       # a hub name: loading it decides
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def check_model_folder(name_or_path: str) -> None:
    """Raise FileNotFoundError ("no such folder") for a name that can only be a local path and is not a folder:
    absolute, starting with `.` or `~`, or with more than one `/` (a hub name is `name` or `owner/name`).

    Example:
        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp(), "model.bin"); _ = file.write_text("")
        >>> check_model_folder(str(file))
        Traceback (most recent call last):
        ...
        FileNotFoundError: model /.../model.bin is a file, not a model folder
        >>> check_model_folder(str(file.parent))            # a folder: loading it decides
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise FileNotFoundError(f"model {name_or_path} is a file, not a model folder")
    if name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path:
        raise FileNotFoundError(f"model {name_or_path}: no such folder")


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Raise ValueError, naming both sizes, when `tokenizer` has more tokens than `model` has input embeddings:
    its ids past the end would fail in the embedding lookup with a bare IndexError.

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer([f"w{i}" for i in range(120)])
        >>> check_vocabulary(tokenizer, tiny_model("bert", vocab=len(tokenizer)))
        >>> check_vocabulary(tokenizer, tiny_model("bert", vocab=100))
        Traceback (most recent call last):
        ...
        ValueError: the tokenizer has 125 tokens but the model (BertModel) has 100 input embeddings: ...
    """
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model ({type(model).__name__}) has {embeddings} input "
            f"embeddings: token ids {embeddings} and above have no embedding. Use the tokenizer the model was "
            "trained with, or call model.resize_token_embeddings(len(tokenizer)) before training"
        )
