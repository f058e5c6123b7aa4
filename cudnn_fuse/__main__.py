"""``python -m cudnn_fuse``: the same CLI as the ``cudnn-fuse`` script."""

from cudnn_fuse.cli import main

raise SystemExit(main())
