"""Profile sync across servers over SSH."""
