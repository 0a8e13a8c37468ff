"""The monitor: per-head entropy (and parent accuracy on a gold set) while training, and entropy collapse.

Example:
    >>> from attnreg.methods.monitor import Monitor
    >>> Monitor(every_n_steps=50).name
    'monitor'
"""

from attnreg.methods.monitor.method import EntropyCollapseWarning, Monitor, MonitorCheck

__all__ = ["EntropyCollapseWarning", "Monitor", "MonitorCheck"]
