"""Stage 4, evaluation: ``evaluate`` runs the recipe's or the command line's eval tasks on an
export (what ships is what is measured); ``report`` writes and compares the results."""
