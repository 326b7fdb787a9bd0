"""The script LLaMA-Factory's launcher relaunches under ``torchrun`` once ``fusedloss.integrations.llamafactory``
is enabled: LLaMA-Factory's own ``launcher.py`` script (``run_exp()``), with the integration enabled first."""

import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder heads sys.path; the package's modules are imported by their full names
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    from fusedloss.integrations.llamafactory import BACKEND_VARIABLE, enable

    enable(os.environ.get(BACKEND_VARIABLE, "auto"))
    from llamafactory.train.tuner import run_exp

    run_exp()
