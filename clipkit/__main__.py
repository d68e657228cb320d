"""``python -m clipkit`` (also what ``accelerate launch -m clipkit train ...`` runs)."""

from clipkit.app.cli import main

main()
