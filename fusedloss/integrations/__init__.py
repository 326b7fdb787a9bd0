"""Integrations at the edge of the library: Hugging Face ``transformers`` models, TRL trainers, and the RL /
fine-tuning frameworks verl, OpenRLHF, Axolotl and LLaMA-Factory.

Nothing here is imported by ``import fusedloss``; each submodule imports its third-party package on
first use, so the core never depends on them::

    from fusedloss.integrations import transformers as fl_hf   # needs transformers
    from fusedloss.integrations import trl as fl_trl           # needs trl >= 1.16, < 2
    from fusedloss.integrations import verl as fl_verl         # needs verl >= 0.9, < 0.10
    from fusedloss.integrations import openrlhf as fl_orl      # needs openrlhf >= 0.11, < 0.12
    # Axolotl config: plugins: [fusedloss.integrations.axolotl.FusedLossPlugin]  (axolotl >= 0.19, < 0.20)
    # LLaMA-Factory: python -m fusedloss.integrations.llamafactory train config.yaml  (llamafactory >= 0.9.5, < 0.10)

``pip install fusedloss[integrations]`` installs the transformers / TRL versions the TRL drop-in and the
Hugging Face patch are tested with. The frameworks bring their own transformers and pin older TRLs: install
fusedloss into their environments without extras. verl, OpenRLHF and Axolotl are tested in their own environment
(``bash tools/frameworks_env.sh``).
"""

# axolotl imports Axolotl at once: its plugin subclasses it
__all__ = ["llamafactory", "openrlhf", "transformers", "trl", "verl"]
