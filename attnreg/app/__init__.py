"""The app around the library: the Hydra training app (`attnreg-train`), multirun tables (`attnreg-collect`),
the analysis CLI (`attnreg-analyze`), model and data factories, the built-in agreement task, evaluation
and the run summary. Nothing below `attnreg.app` imports it.
"""
