"""colibri_inspect: verification, planning and readiness checks for Colibri containers."""
