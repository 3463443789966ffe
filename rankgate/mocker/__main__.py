"""``python -m mocker``: the mock vLLM engine on the command line."""

import sys

from rankgate.mocker.cli import main

sys.exit(main())
