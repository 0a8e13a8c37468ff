"""Hydra configs of the training app (`attnreg-train`); a package so that an installed app finds them."""
