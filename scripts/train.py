"""`python scripts/train.py [overrides]`: the same as the `attnreg-train` console script (attnreg/train.py)."""

from attnreg.train import main

if __name__ == "__main__":
    main()
