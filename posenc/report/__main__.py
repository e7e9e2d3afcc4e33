"""``python -m posenc.report <sweep dir> ...``: the sweep report (:func:`posenc.report.main`)."""

from posenc.report import main

raise SystemExit(main())
