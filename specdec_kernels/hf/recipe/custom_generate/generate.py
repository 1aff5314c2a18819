"""``model.generate(..., custom_generate=specdec_kernels.hf.CUSTOM_GENERATE, trust_remote_code=True)``.

Transformers loads this file from the package's own directory (a local path, nothing is downloaded)
and calls ``generate`` with every argument of ``model.generate``. The work happens in
:func:`specdec_kernels.hf.integration.generate_with_specdec`.
"""


def generate(model, **generate_arguments):
    from specdec_kernels.hf.integration import generate_with_specdec

    return generate_with_specdec(model, **generate_arguments)
