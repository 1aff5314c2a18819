"""specdec_kernels: fused, exact verification kernels for speculative decoding.

Without CUDA the Triton kernels run in Triton's interpreter (slow, but exact): we set
``TRITON_INTERPRET=1`` before any kernel is defined, unless the user already chose.
"""

from ._interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()

from ._types import TreeMetadata, TreeVerifyOutput, VerifyOutput  # noqa: E402
from .api import verify, verify_multi, verify_tree  # noqa: E402
from .ops import tree_attention, tree_metadata  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "TreeMetadata",
    "TreeVerifyOutput",
    "VerifyOutput",
    "tree_attention",
    "tree_metadata",
    "verify",
    "verify_multi",
    "verify_tree",
    "__version__",
]
