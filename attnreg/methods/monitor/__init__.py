"""The attention monitor: per-head entropy (and parent accuracy on a gold set) while training, and entropy
collapse.

Example:
    >>> from attnreg.methods.monitor import AttentionMonitor
    >>> AttentionMonitor(every_n_steps=50).name
    'attention_monitor'
"""

from attnreg.methods.monitor.method import AttentionMonitor, EntropyCollapseWarning, MonitorCheck

__all__ = ["AttentionMonitor", "EntropyCollapseWarning", "MonitorCheck"]
