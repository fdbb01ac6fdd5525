"""Prepare a corpus for training, once, before the job: see data/prepare_data.py (same as `python -m data.prepare_data`).

    python scripts/prepare_data.py --input corpus/ --output data/prepared --tokenizer_name_or_path TOK --workers 8
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.prepare_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
