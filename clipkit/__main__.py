"""``python -m clipkit`` (also what ``accelerate launch -m clipkit train ...`` runs)."""

from clipkit.cli import main

main()
