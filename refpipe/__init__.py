"""refpipe: per-token side-channel arrays of LLM RL training, passed by reference.

The subpackages are installed from the top-level folders of the repository
(``storage/``, ``pipeline/``, ``trainer/``, ``job/``, ``cli/``, ``integrations/``)
as ``refpipe.storage`` and so on; nothing of refpipe is importable under a bare name.
"""

from importlib.metadata import version as _version

__version__ = _version("refpipe")
