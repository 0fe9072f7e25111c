"""``jabas report``: PNG plots and an ``index.html`` for a run folder or a ``jabas simulate --json`` file.

:func:`write_report` reads the source (:mod:`.sources`), draws each plot with
matplotlib's Agg backend (:mod:`.plots`) and writes the page (:mod:`.html`).
Every file is written atomically, so a report of a run that is still going is
complete at every moment; it shows what the run has logged so far.
"""

from jabascli.report.build import Report, default_out, write_report

__all__ = ["Report", "default_out", "write_report"]
