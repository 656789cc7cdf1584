"""Accelerate's old module name for the memory helpers (`accelerate.memory_utils`): importing it warns, as there;
the helpers live in `nbaccel.utils.memory` and `find_executable_batch_size` at the top level."""

import warnings

warnings.warn("nbaccel.memory_utils is the old home of the memory helpers: import find_executable_batch_size "
              "from nbaccel (or nbaccel.utils) instead.", FutureWarning, stacklevel=2)
