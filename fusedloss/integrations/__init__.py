"""Integrations at the edge of the library: Hugging Face ``transformers`` models, TRL trainers, and the RL /
fine-tuning frameworks verl, OpenRLHF and Axolotl.

Nothing here is imported by ``import fusedloss``; each submodule imports its third-party package on
first use, so the core never depends on them::

    from fusedloss.integrations import transformers as fl_hf   # needs transformers
    from fusedloss.integrations import trl as fl_trl           # needs trl >= 1.16, < 2
    from fusedloss.integrations import verl as fl_verl         # needs verl >= 0.9, < 0.10
    from fusedloss.integrations import openrlhf as fl_orl      # needs openrlhf >= 0.11, < 0.12
    # Axolotl config: plugins: [fusedloss.integrations.axolotl.FusedLossPlugin]  (axolotl >= 0.19, < 0.20)

``pip install fusedloss[integrations]`` installs the transformers / TRL versions they are tested with; verl,
OpenRLHF and Axolotl are tested in their own environment (``bash tools/frameworks_env.sh``).
"""

__all__ = ["openrlhf", "transformers", "trl", "verl"]  # axolotl imports Axolotl at once: its plugin subclasses it
