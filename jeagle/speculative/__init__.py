"""The speculative round: tree drafting, tree building, verification, acceptance, commit, draft extend."""
