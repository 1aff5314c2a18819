"""``python -m specdec_kernels.cli``: the ``specdec`` console script."""

import sys

from .parser import main

sys.exit(main())
