"""``python -m mocker``: the mock vLLM engine on the command line."""

import sys

from mocker.cli import main

sys.exit(main())
