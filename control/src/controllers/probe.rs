pub fn register(_: &mut crate::runtime::Runtime) -> Result<(), crate::runtime::RegistrationError> {
    Ok(())
}
