"""``python -m fusedloss.integrations.llamafactory train cfg.yaml``: ``llamafactory-cli train cfg.yaml`` with the
integration enabled here and in the processes LLaMA-Factory relaunches (``FUSEDLOSS_LLAMAFACTORY_BACKEND``,
default ``auto``, picks the backend)."""

import os

from . import BACKEND_VARIABLE, enable

if __name__ == "__main__":
    enable(os.environ.get(BACKEND_VARIABLE, "auto"))
    from llamafactory.cli import main

    main()
