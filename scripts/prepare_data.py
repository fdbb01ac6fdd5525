"""Prepare a corpus for training, once, before the job: see data/prepare_data.py (same as `python -m data.prepare_data`).

    python scripts/prepare_data.py --input corpus/ --output data/prepared --tokenizer_name_or_path TOK --workers 8
"""

import sys

from data.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
