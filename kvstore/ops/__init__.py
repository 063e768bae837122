"""Operations on whole stores: migration, inspection, verification, garbage collection."""
