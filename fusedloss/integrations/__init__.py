"""Integrations at the edge of the library: Hugging Face ``transformers`` models and TRL trainers.

Nothing here is imported by ``import fusedloss``; each submodule imports its third-party package on
first use, so the core never depends on them::

    from fusedloss.integrations import transformers as fl_hf   # needs transformers
    from fusedloss.integrations import trl as fl_trl           # needs trl >= 1.16, < 2

``pip install fusedloss[integrations]`` installs the versions they are tested with.
"""

__all__ = ["transformers", "trl"]
