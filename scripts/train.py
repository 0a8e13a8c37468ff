"""`python scripts/train.py [overrides]`: the same as the `attnreg-train` console script (attnreg/app/train.py)."""

from attnreg.app.train import main

if __name__ == "__main__":
    main()
