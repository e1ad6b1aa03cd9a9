//! Whether this CPU and OS run AMX's tile instructions ([`super::amx()`] decides whether the
//! kernels use them): CPUID, XCR0 and Linux's permission for the tiles' state.

/// Whether this CPU has AMX's tiles and 8-bit products, the OS saves the tiles' state (XCR0
/// bits 17 and 18), and it lets this process use them (Linux asks each process to request
/// the tile data's state, `arch_prctl(ARCH_REQ_XCOMP_PERM)`; without it the first tile
/// instruction faults). Asked once; std's `is_x86_feature_detected!` has no stable AMX names.
pub(super) fn cpu_has_amx() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            use std::arch::x86_64::{__cpuid, __cpuid_count};
            // SAFETY: CPUID runs on every x86-64 CPU (a safe function since Rust 1.91).
            #[allow(unused_unsafe)]
            let (max, leaf1, leaf7) = unsafe { (__cpuid(0).eax, __cpuid(1), __cpuid_count(7, 0)) };
            // Leaf 7's EDX: bit 24 AMX-TILE, bit 25 AMX-INT8. Leaf 1's ECX bit 27: OSXSAVE.
            let tiles = max >= 7 && leaf7.edx & (3 << 24) == 3 << 24;
            if !tiles || leaf1.ecx & (1 << 27) == 0 {
                return false;
            }
            // SAFETY: OSXSAVE is set, so XGETBV runs.
            let xcr0 = unsafe { xcr0() };
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a request for a permission; it touches no memory of ours.
            let granted = unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            } == 0;
            xcr0 & (3 << 17) == 3 << 17 && granted
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// XCR0, the state components the OS saves.
///
/// # Safety
/// The CPU has OSXSAVE (CPUID leaf 1, ECX bit 27).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}
