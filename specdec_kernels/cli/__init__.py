"""Command line: ``specdec demo``, ``specdec generate`` and ``specdec verify-demo``.

One module per subcommand (``demo``, ``generate``, ``verify_demo``), the parser and entry point in
``parser``, what they share in ``_common``. Run as ``specdec ...`` or ``python -m specdec_kernels.cli ...``.
"""

from ._common import UsageError
from .parser import main

__all__ = ["UsageError", "main"]
