"""Reports: the paper's tables and figures from run directories (``lnstab report``).

:mod:`lnstab.report.collect` reads runs back, :mod:`lnstab.report.tables` builds the divergence, performance and
stability tables, :mod:`lnstab.report.figures` draws the figures, :mod:`lnstab.report.cli` writes them.
"""

from lnstab.report.collect import ReportError, RunRecord, collect
from lnstab.report.tables import divergence_table, group, performance_table, stability_table

__all__ = ["ReportError", "RunRecord", "collect", "divergence_table", "group", "performance_table",
           "stability_table"]
