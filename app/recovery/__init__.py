"""Fault handling: the timing budget (policy), lost peers, hung peers and the exits they lead to."""
