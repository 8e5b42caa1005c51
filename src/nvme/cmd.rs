//! NVMe command encodings for the Linux passthrough interfaces: pure functions that build the
//! 72-byte `struct nvme_passthru_cmd` / `struct nvme_uring_cmd` (uapi `linux/nvme_ioctl.h`;
//! both have the same layout, only the last dword differs: `result` vs `rsvd2`).
//!
//! The builders leave `addr`/`data_len` for the caller to fill with [`PassthruCmd::with_data`]
//! where the command moves data, except that they set `data_len` where the length follows from
//! the command (identify, log pages, RUH status, DSM ranges); the caller then only sets `addr`.
//!
//! Field layouts are from the NVMe Base Specification 2.0 (I/O: NVM Command Set spec 1.0) as
//! summarised in `fdp-waf.md` §2 and §3.1 of the project's reference notes, and cross-checked
//! against libnvme (`src/nvme/types.h`, `src/nvme/api-types.h`, `src/nvme/ioctl.c`).

use std::fmt;

/// Size of the passthrough command structure in bytes.
pub const CMD_BYTES: usize = 72;

/// Admin command opcodes (NVMe Base spec, Figure "Opcodes for Admin Commands").
pub mod admin_opc {
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0A;
}

/// NVM command set I/O opcodes.
pub mod io_opc {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DSM: u8 = 0x09;
    pub const IO_MGMT_RECV: u8 = 0x12;
    pub const IO_MGMT_SEND: u8 = 0x1D;
}

/// Log page identifiers of the FDP logs (LSI = endurance group id).
pub mod lid {
    pub const FDP_CONFIGS: u8 = 0x20;
    pub const RUH_USAGE: u8 = 0x21;
    pub const FDP_STATS: u8 = 0x22;
    pub const FDP_EVENTS: u8 = 0x23;
}

/// Feature identifiers.
pub mod fid {
    /// Flexible Data Placement: CDW11 = ENDGID, DW0 bit 0 = FDPE, bits 15:8 = FDPCIDX.
    pub const FDP: u8 = 0x1D;
    /// FDP Events.
    pub const FDP_EVENTS: u8 = 0x1E;
}

/// Identify CNS values.
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NSID_LIST: u8 = 0x02;
}

/// Directive type for placement in CDW12 bits 23:20 of a write (2 = Data Placement).
pub const DTYPE_DATA_PLACEMENT: u32 = 2;
/// Most logical blocks one read/write/write-zeroes command carries (NLB is a 0-based u16).
pub const MAX_NLB: u32 = 65_536;
/// Most ranges one Dataset Management command carries (NR is a 0-based u8).
pub const MAX_DSM_RANGES: usize = 256;
/// Size of one Dataset Management range.
pub const DSM_RANGE_BYTES: usize = 16;

/// `struct nvme_passthru_cmd` / `struct nvme_uring_cmd`, 72 bytes, native (little) endian.
///
/// | off | field | off | field |
/// |---|---|---|---|
/// | 0 | opcode u8 | 36 | data_len u32 |
/// | 1 | flags u8 | 40..60 | cdw10..cdw15 u32 |
/// | 2 | rsvd1 u16 | 64 | timeout_ms u32 |
/// | 4 | nsid u32 | 68 | result u32 (ioctl) / rsvd2 (io_uring) |
/// | 8, 12 | cdw2, cdw3 | | |
/// | 16 | metadata u64 (pointer) | | |
/// | 24 | addr u64 (pointer) | | |
/// | 32 | metadata_len u32 | | |
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassthruCmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    /// Command result DW0 after an ioctl; `rsvd2` in `struct nvme_uring_cmd` (leave it 0).
    pub result: u32,
}

const _: () = assert!(std::mem::size_of::<PassthruCmd>() == CMD_BYTES);
const _: () = assert!(std::mem::align_of::<PassthruCmd>() == 8);

impl PassthruCmd {
    /// A command with only the opcode and namespace set.
    pub fn new(opcode: u8, nsid: u32) -> Self {
        PassthruCmd { opcode, nsid, ..Default::default() }
    }

    /// Sets the data buffer address and length.
    pub fn with_data(mut self, addr: u64, data_len: u32) -> Self {
        self.addr = addr;
        self.data_len = data_len;
        self
    }

    /// The 72 bytes as the kernel reads them (little-endian), for the 80-byte `cmd` area of a
    /// 128-byte io_uring SQE (`IORING_OP_URING_CMD`, `cmd_op = NVME_URING_CMD_IO`).
    pub fn to_bytes(&self) -> [u8; CMD_BYTES] {
        let mut b = [0u8; CMD_BYTES];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.rsvd1.to_le_bytes());
        let dwords: [(usize, u32); 13] = [
            (4, self.nsid),
            (8, self.cdw2),
            (12, self.cdw3),
            (32, self.metadata_len),
            (36, self.data_len),
            (40, self.cdw10),
            (44, self.cdw11),
            (48, self.cdw12),
            (52, self.cdw13),
            (56, self.cdw14),
            (60, self.cdw15),
            (64, self.timeout_ms),
            (68, self.result),
        ];
        for (off, v) in dwords {
            b[off..off + 4].copy_from_slice(&v.to_le_bytes());
        }
        b[16..24].copy_from_slice(&self.metadata.to_le_bytes());
        b[24..32].copy_from_slice(&self.addr.to_le_bytes());
        b
    }

    /// Parses 72 bytes laid out as [`PassthruCmd::to_bytes`] writes them.
    pub fn from_bytes(b: &[u8; CMD_BYTES]) -> Self {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from(u32_at(o)) | (u64::from(u32_at(o + 4)) << 32);
        PassthruCmd {
            opcode: b[0],
            flags: b[1],
            rsvd1: u16::from_le_bytes([b[2], b[3]]),
            nsid: u32_at(4),
            cdw2: u32_at(8),
            cdw3: u32_at(12),
            metadata: u64_at(16),
            addr: u64_at(24),
            metadata_len: u32_at(32),
            data_len: u32_at(36),
            cdw10: u32_at(40),
            cdw11: u32_at(44),
            cdw12: u32_at(48),
            cdw13: u32_at(52),
            cdw14: u32_at(56),
            cdw15: u32_at(60),
            timeout_ms: u32_at(64),
            result: u32_at(68),
        }
    }
}

/// Why a command cannot be encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmdError {
    /// The block count is 0 or above [`MAX_NLB`]; split the request.
    BlockCount(u64),
    /// `slba + nlb` passes the end of the 64-bit LBA space.
    LbaOverflow { slba: u64, nlb: u64 },
    /// 0 or more than [`MAX_DSM_RANGES`] DSM ranges.
    RangeCount(usize),
    /// A DSM range of 0 blocks.
    EmptyRange { slba: u64 },
    /// A transfer length that is 0, not a multiple of 4 or too large for the NUMD field.
    Length(u64),
    /// More placement identifiers than one RUH Update can carry (1..=65536).
    PidCount(usize),
    /// The output buffer is too small.
    Buffer { need: usize, have: usize },
}

impl fmt::Display for CmdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CmdError::BlockCount(n) => {
                write!(f, "{n} logical blocks in one NVMe command; it takes 1 to {MAX_NLB} (split the request)")
            }
            CmdError::LbaOverflow { slba, nlb } => write!(f, "LBA range {slba}+{nlb} passes the end of the LBA space"),
            CmdError::RangeCount(n) => {
                write!(f, "{n} ranges in one Dataset Management command; it takes 1 to {MAX_DSM_RANGES} (split them)")
            }
            CmdError::EmptyRange { slba } => write!(f, "Dataset Management range at LBA {slba} has 0 blocks"),
            CmdError::Length(n) => {
                write!(f, "transfer length {n} is not a positive multiple of 4 that NUMD can express")
            }
            CmdError::PidCount(n) => write!(f, "{n} placement identifiers in one RUH Update; it takes 1 to 65536"),
            CmdError::Buffer { need, have } => write!(f, "buffer of {have} bytes, {need} needed"),
        }
    }
}

impl std::error::Error for CmdError {}

fn check_nlb(slba: u64, nlb: u32) -> Result<u32, CmdError> {
    if nlb == 0 || nlb > MAX_NLB {
        return Err(CmdError::BlockCount(u64::from(nlb)));
    }
    slba.checked_add(u64::from(nlb) - 1).ok_or(CmdError::LbaOverflow { slba, nlb: u64::from(nlb) })?;
    Ok(nlb - 1)
}

fn rw(opcode: u8, nsid: u32, slba: u64, nlb: u32) -> Result<PassthruCmd, CmdError> {
    let nlb0 = check_nlb(slba, nlb)?;
    let mut c = PassthruCmd::new(opcode, nsid);
    c.cdw10 = slba as u32;
    c.cdw11 = (slba >> 32) as u32;
    c.cdw12 = nlb0;
    Ok(c)
}

/// Read (0x02) of `nlb` blocks (1..=65536) at `slba`. Set the buffer with `with_data`.
pub fn read(nsid: u32, slba: u64, nlb: u32) -> Result<PassthruCmd, CmdError> {
    rw(io_opc::READ, nsid, slba, nlb)
}

/// Write (0x01) of `nlb` blocks (1..=65536) at `slba`.
///
/// With `pid = Some(p)` the write carries the Data Placement directive: DTYPE = 2 in CDW12
/// bits 23:20 and DSPEC = `p` in CDW13 bits 31:16. Without it the drive places the data on
/// placement handle 0. `fua` sets CDW12 bit 30. Set the buffer with `with_data`.
pub fn write(nsid: u32, slba: u64, nlb: u32, pid: Option<u16>, fua: bool) -> Result<PassthruCmd, CmdError> {
    let mut c = rw(io_opc::WRITE, nsid, slba, nlb)?;
    if let Some(p) = pid {
        c.cdw12 |= DTYPE_DATA_PLACEMENT << 20;
        c.cdw13 = u32::from(p) << 16;
    }
    if fua {
        c.cdw12 |= 1 << 30;
    }
    Ok(c)
}

/// Flush (0x00).
pub fn flush(nsid: u32) -> PassthruCmd {
    PassthruCmd::new(io_opc::FLUSH, nsid)
}

/// Write Zeroes (0x08) of `nlb` blocks (1..=65536). Unless `nounmap`, sets DEAC (CDW12 bit
/// 25) so the drive may deallocate the blocks instead of writing zeroes.
///
/// `pid` places the zeroes the drive writes, in the same fields as [`write`] (the Data
/// Placement directive applies to Write Zeroes too); without it they land on placement
/// handle 0.
pub fn write_zeroes(nsid: u32, slba: u64, nlb: u32, nounmap: bool, pid: Option<u16>) -> Result<PassthruCmd, CmdError> {
    let mut c = rw(io_opc::WRITE_ZEROES, nsid, slba, nlb)?;
    if !nounmap {
        c.cdw12 |= 1 << 25;
    }
    if let Some(p) = pid {
        c.cdw12 |= DTYPE_DATA_PLACEMENT << 20;
        c.cdw13 = u32::from(p) << 16;
    }
    Ok(c)
}

/// One Dataset Management range: `nlb` blocks (1-based, unlike the I/O commands) from `slba`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsmRange {
    pub cattr: u32,
    pub nlb: u32,
    pub slba: u64,
}

impl DsmRange {
    pub fn new(slba: u64, nlb: u32) -> Self {
        DsmRange { cattr: 0, nlb, slba }
    }

    /// Splits `nlb` blocks from `slba` into ranges of at most `u32::MAX` blocks.
    pub fn split(slba: u64, nlb: u64) -> impl Iterator<Item = DsmRange> {
        Self::split_at(slba, nlb, u32::MAX)
    }

    /// [`DsmRange::split`] into ranges of at most `max` blocks (the drive's DMRSL).
    pub fn split_at(slba: u64, nlb: u64, max: u32) -> impl Iterator<Item = DsmRange> {
        let max = u64::from(max.max(1));
        let mut at = slba;
        let mut left = nlb;
        std::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            let n = left.min(max) as u32;
            let r = DsmRange::new(at, n);
            at = at.wrapping_add(u64::from(n));
            left -= u64::from(n);
            Some(r)
        })
    }
}

/// Encodes ranges as the 16-byte `{u32 cattr, u32 nlb, u64 slba}` records DSM reads.
pub fn encode_dsm_ranges(ranges: &[DsmRange]) -> Result<Vec<u8>, CmdError> {
    let mut out = vec![0u8; ranges.len() * DSM_RANGE_BYTES];
    encode_dsm_ranges_into(ranges, &mut out)?;
    Ok(out)
}

/// Like [`encode_dsm_ranges`] into a caller's buffer (at least 16 × ranges bytes); returns the
/// bytes written.
pub fn encode_dsm_ranges_into(ranges: &[DsmRange], out: &mut [u8]) -> Result<usize, CmdError> {
    if ranges.is_empty() || ranges.len() > MAX_DSM_RANGES {
        return Err(CmdError::RangeCount(ranges.len()));
    }
    let need = ranges.len() * DSM_RANGE_BYTES;
    if out.len() < need {
        return Err(CmdError::Buffer { need, have: out.len() });
    }
    for (r, b) in ranges.iter().zip(out.chunks_exact_mut(DSM_RANGE_BYTES)) {
        if r.nlb == 0 {
            return Err(CmdError::EmptyRange { slba: r.slba });
        }
        r.slba
            .checked_add(u64::from(r.nlb) - 1)
            .ok_or(CmdError::LbaOverflow { slba: r.slba, nlb: u64::from(r.nlb) })?;
        b[0..4].copy_from_slice(&r.cattr.to_le_bytes());
        b[4..8].copy_from_slice(&r.nlb.to_le_bytes());
        b[8..16].copy_from_slice(&r.slba.to_le_bytes());
    }
    Ok(need)
}

/// Dataset Management (0x09) with Attribute Deallocate (CDW11 bit 2) over `nr` ranges
/// (1..=256): CDW10 = nr − 1, `data_len` = 16 × nr. Point `addr` at the encoded ranges.
pub fn dsm_deallocate(nsid: u32, nr: usize) -> Result<PassthruCmd, CmdError> {
    if nr == 0 || nr > MAX_DSM_RANGES {
        return Err(CmdError::RangeCount(nr));
    }
    let mut c = PassthruCmd::new(io_opc::DSM, nsid);
    c.cdw10 = (nr - 1) as u32;
    c.cdw11 = 1 << 2;
    c.data_len = (nr * DSM_RANGE_BYTES) as u32;
    Ok(c)
}

/// Dwords − 1 for a transfer of `len` bytes (a positive multiple of 4).
fn numd(len: u32) -> Result<u32, CmdError> {
    if len == 0 || !len.is_multiple_of(4) {
        return Err(CmdError::Length(u64::from(len)));
    }
    Ok(len / 4 - 1)
}

/// I/O Management Receive (0x12), Management Operation 1 = Reclaim Unit Handle Status, for a
/// buffer of `len` bytes: CDW10 = MO (7:0) | MOS (31:16) = 1, CDW11 = NUMD (0-based dwords).
pub fn ruh_status(nsid: u32, len: u32) -> Result<PassthruCmd, CmdError> {
    let mut c = PassthruCmd::new(io_opc::IO_MGMT_RECV, nsid);
    c.cdw10 = 1;
    c.cdw11 = numd(len)?;
    c.data_len = len;
    Ok(c)
}

/// I/O Management Send (0x1D), Management Operation 1 = Reclaim Unit Handle Update, for
/// `npids` placement identifiers: CDW10 = 1 | (npids − 1) << 16, data = u16 PIDs
/// ([`encode_pids`]). The drive starts a fresh reclaim unit on each handle.
pub fn ruh_update(nsid: u32, npids: usize) -> Result<PassthruCmd, CmdError> {
    if npids == 0 || npids > 65_536 {
        return Err(CmdError::PidCount(npids));
    }
    let mut c = PassthruCmd::new(io_opc::IO_MGMT_SEND, nsid);
    c.cdw10 = 1 | (((npids - 1) as u32) << 16);
    c.data_len = (npids * 2) as u32;
    Ok(c)
}

/// The PID list of a RUH Update: little-endian u16s.
pub fn encode_pids(pids: &[u16]) -> Vec<u8> {
    pids.iter().flat_map(|p| p.to_le_bytes()).collect()
}

/// Get Log Page (admin 0x02) of `len` bytes from byte `offset`:
/// CDW10 = LID (7:0) | LSP (14:8) | RAE (15) | NUMDL (31:16),
/// CDW11 = NUMDU (15:0) | LSI (31:16), CDW12/13 = offset low/high.
/// `nsid` is 0 for the FDP logs (they are scoped by LSI = endurance group).
pub fn get_log_page(nsid: u32, lid: u8, lsp: u8, lsi: u16, offset: u64, len: u32) -> Result<PassthruCmd, CmdError> {
    let nd = numd(len)?;
    if !offset.is_multiple_of(4) {
        return Err(CmdError::Length(offset));
    }
    let mut c = PassthruCmd::new(admin_opc::GET_LOG_PAGE, nsid);
    c.cdw10 = u32::from(lid) | (u32::from(lsp & 0x7f) << 8) | ((nd & 0xffff) << 16);
    c.cdw11 = (nd >> 16) | (u32::from(lsi) << 16);
    c.cdw12 = offset as u32;
    c.cdw13 = (offset >> 32) as u32;
    c.data_len = len;
    Ok(c)
}

/// Identify (admin 0x06): CDW10 = CNS (7:0) | CNTID (31:16); 4096 bytes of data.
pub fn identify(cns: u8, nsid: u32) -> PassthruCmd {
    let mut c = PassthruCmd::new(admin_opc::IDENTIFY, nsid);
    c.cdw10 = u32::from(cns);
    c.data_len = 4096;
    c
}

/// Get Features (admin 0x0A): CDW10 = FID (7:0) | SEL (10:8) (0 = current), CDW11 as the
/// feature defines (FDP: the endurance group). The value comes back in the result (DW0).
pub fn get_features(fid: u8, sel: u8, cdw11: u32) -> PassthruCmd {
    let mut c = PassthruCmd::new(admin_opc::GET_FEATURES, 0);
    c.cdw10 = u32::from(fid) | (u32::from(sel & 7) << 8);
    c.cdw11 = cdw11;
    c
}

/// The 15-bit NVMe status the Linux passthrough ioctls return when the command failed on
/// the drive (the completion's status field without the phase bit): SC (7:0), SCT (10:8),
/// CRD (12:11), More (13), DNR (14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvmeStatus(pub u16);

impl NvmeStatus {
    pub fn sc(self) -> u8 {
        self.0 as u8
    }
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 7) as u8
    }
    pub fn dnr(self) -> bool {
        self.0 & (1 << 14) != 0
    }
    /// Command Retry Delay: 0, or which of the controller's CRDT1..3 to wait before a retry.
    pub fn crd(self) -> u8 {
        ((self.0 >> 11) & 3) as u8
    }
    /// Status code type and code without retry/more bits.
    pub fn code(self) -> u16 {
        self.0 & 0x7ff
    }
    /// Successful Completion, whatever its More or Do Not Retry bit says: the kernel's own
    /// NVMe driver (`nvme_error_status`) looks at the status code alone.
    pub fn succeeded(self) -> bool {
        self.code() == 0
    }
    /// The spec's name of common statuses.
    pub fn name(self) -> &'static str {
        match (self.sct(), self.sc()) {
            (0, 0x00) => "Successful Completion",
            (0, 0x01) => "Invalid Command Opcode",
            (0, 0x02) => "Invalid Field in Command",
            (0, 0x04) => "Data Transfer Error",
            (0, 0x06) => "Internal Error",
            (0, 0x0B) => "Invalid Namespace or Format",
            (0, 0x0F) => "Data SGL Length Invalid",
            (0, 0x29) => "FDP Disabled",
            (0, 0x2A) => "Invalid Placement Handle List",
            (0, 0x80) => "LBA Out of Range",
            (0, 0x81) => "Capacity Exceeded",
            (0, 0x82) => "Namespace Not Ready",
            (1, 0x02) => "Invalid Queue Size",
            (1, 0x09) => "Invalid Log Page",
            (1, 0x0D) => "Feature Identifier Not Saveable",
            (1, 0x0E) => "Feature Not Changeable",
            (2, 0x80) => "Write Fault",
            (2, 0x81) => "Unrecovered Read Error",
            _ => "",
        }
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.name();
        if n.is_empty() {
            write!(f, "NVMe status {:#06x} (type {}, code {:#04x})", self.0, self.sct(), self.sc())
        } else {
            write!(f, "NVMe status {:#06x}: {n}", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dw(b: &[u8; CMD_BYTES], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    #[test]
    fn struct_layout_matches_uapi() {
        let c = PassthruCmd {
            opcode: 0x11,
            flags: 0x22,
            rsvd1: 0x3344,
            nsid: 0x5566_7788,
            cdw2: 0x0202_0202,
            cdw3: 0x0303_0303,
            metadata: 0x1010_1010_1010_1010,
            addr: 0x2424_2424_2424_2424,
            metadata_len: 0x3232_3232,
            data_len: 0x3636_3636,
            cdw10: 0x4040_4040,
            cdw11: 0x4444_4444,
            cdw12: 0x4848_4848,
            cdw13: 0x5252_5252,
            cdw14: 0x5656_5656,
            cdw15: 0x6060_6060,
            timeout_ms: 0x6464_6464,
            result: 0x6868_6868,
        };
        let b = c.to_bytes();
        assert_eq!(&b[0..4], &[0x11, 0x22, 0x44, 0x33]);
        assert_eq!(dw(&b, 4), 0x5566_7788);
        // Every other field's bytes repeat its offset (hex), so the layout shows directly.
        for off in [8usize, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68] {
            let want = match off {
                8 => 0x02,
                12 => 0x03,
                16 | 20 => 0x10,
                24 | 28 => 0x24,
                o => ((o / 10) << 4 | (o % 10)) as u8,
            };
            assert!(b[off..off + 4].iter().all(|&x| x == want), "offset {off}: {:x?}", &b[off..off + 4]);
        }
        assert_eq!(PassthruCmd::from_bytes(&b), c);
        // The in-memory layout (what the ioctl passes) is the same as to_bytes on this LE host.
        #[cfg(target_endian = "little")]
        {
            let mem: [u8; CMD_BYTES] = unsafe { std::mem::transmute(c) };
            assert_eq!(mem, b);
        }
    }

    #[test]
    fn write_with_placement() {
        let c = write(1, 0x1_2345_6789, 8, Some(3), false).unwrap();
        let b = c.to_bytes();
        assert_eq!(b[0], 0x01);
        assert_eq!(dw(&b, 4), 1);
        assert_eq!(dw(&b, 40), 0x2345_6789); // SLBA low
        assert_eq!(dw(&b, 44), 0x1); // SLBA high
        assert_eq!(dw(&b, 48), 7 | (2 << 20)); // NLB 0-based, DTYPE 2
        assert_eq!(dw(&b, 52), 3 << 16); // DSPEC = PID
        assert_eq!(dw(&b, 36), 0, "data_len is the caller's");
        let c = write(1, 0, MAX_NLB, Some(0xffff), true).unwrap();
        assert_eq!(c.cdw12, 0xffff | (2 << 20) | (1 << 30));
        assert_eq!(c.cdw13, 0xffff_0000);
        // As the kernel tracepoint decodes it: ctrl = cdw12 >> 16, DTYPE = ctrl bits 7:4.
        assert_eq!(((c.cdw12 >> 16) >> 4) & 0xf, 2);
        // No directive: DTYPE 0, DSPEC 0.
        let c = write(7, 100, 1, None, false).unwrap();
        assert_eq!((c.cdw10, c.cdw11, c.cdw12, c.cdw13), (100, 0, 0, 0));
        assert_eq!(c.nsid, 7);
    }

    #[test]
    fn block_count_limits() {
        assert_eq!(write(1, 0, 0, None, false), Err(CmdError::BlockCount(0)));
        assert_eq!(write(1, 0, MAX_NLB + 1, Some(1), false), Err(CmdError::BlockCount(65_537)));
        assert_eq!(read(1, 0, MAX_NLB + 1), Err(CmdError::BlockCount(65_537)));
        assert_eq!(write_zeroes(1, 0, 0, false, None), Err(CmdError::BlockCount(0)));
        assert!(matches!(read(1, u64::MAX, 2), Err(CmdError::LbaOverflow { .. })));
        assert!(read(1, u64::MAX, 1).is_ok());
        assert!(CmdError::BlockCount(65_537).to_string().contains("split"));
    }

    #[test]
    fn read_flush_write_zeroes() {
        let c = read(2, 0xAABB_CCDD_0011_2233, 16).unwrap();
        assert_eq!((c.opcode, c.nsid, c.cdw10, c.cdw11, c.cdw12, c.cdw13), (0x02, 2, 0x0011_2233, 0xAABB_CCDD, 15, 0));
        let c = flush(1);
        assert_eq!(c.to_bytes()[..8], [0, 0, 0, 0, 1, 0, 0, 0]);
        assert!(c.to_bytes()[8..].iter().all(|&x| x == 0));
        let c = write_zeroes(1, 5, 4, false, None).unwrap();
        assert_eq!((c.opcode, c.cdw10, c.cdw12, c.cdw13), (0x08, 5, 3 | (1 << 25), 0));
        let c = write_zeroes(1, 5, 4, true, None).unwrap();
        assert_eq!((c.cdw12, c.cdw13), (3, 0));
        // Placed: DTYPE 2 in CDW12 bits 23:20, DSPEC in CDW13 bits 31:16, as a Write.
        let c = write_zeroes(1, 5, 4, true, Some(0x0102)).unwrap();
        assert_eq!((c.cdw12, c.cdw13), (3 | (2 << 20), 0x0102_0000));
        let w = write(1, 5, 4, Some(0x0102), false).unwrap();
        assert_eq!((c.cdw12 & 0x00f0_0000, c.cdw13), (w.cdw12 & 0x00f0_0000, w.cdw13));
    }

    #[test]
    fn dsm_ranges_and_command() {
        let r = [DsmRange::new(0x0102_0304_0506_0708, 0x1122_3344), DsmRange { cattr: 0xdead_beef, nlb: 1, slba: 0 }];
        let b = encode_dsm_ranges(&r).unwrap();
        assert_eq!(b.len(), 32);
        assert_eq!(&b[0..4], &[0, 0, 0, 0]);
        assert_eq!(&b[4..8], &[0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&b[8..16], &[0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01]);
        assert_eq!(&b[16..20], &[0xef, 0xbe, 0xad, 0xde]);
        assert_eq!(&b[20..24], &[1, 0, 0, 0]);
        let c = dsm_deallocate(1, 2).unwrap();
        assert_eq!((c.opcode, c.cdw10, c.cdw11, c.data_len), (0x09, 1, 4, 32));
        assert_eq!(dsm_deallocate(1, 256).unwrap().cdw10, 255);
        assert_eq!(dsm_deallocate(1, 0), Err(CmdError::RangeCount(0)));
        assert_eq!(dsm_deallocate(1, 257), Err(CmdError::RangeCount(257)));
        assert_eq!(encode_dsm_ranges(&[]), Err(CmdError::RangeCount(0)));
        assert_eq!(encode_dsm_ranges(&[DsmRange::new(9, 0)]), Err(CmdError::EmptyRange { slba: 9 }));
        assert_eq!(encode_dsm_ranges(&vec![DsmRange::new(0, 1); 257]), Err(CmdError::RangeCount(257)));
        let mut small = [0u8; 15];
        assert_eq!(encode_dsm_ranges_into(&r[..1], &mut small), Err(CmdError::Buffer { need: 16, have: 15 }));
        let parts: Vec<_> = DsmRange::split(10, u64::from(u32::MAX) + 5).collect();
        assert_eq!(parts, vec![DsmRange::new(10, u32::MAX), DsmRange::new(10 + u64::from(u32::MAX), 5)]);
        assert_eq!(DsmRange::split(1, 0).count(), 0);
        let small: Vec<_> = DsmRange::split_at(10, 2500, 1000).map(|r| (r.slba, r.nlb)).collect();
        assert_eq!(small, vec![(10, 1000), (1010, 1000), (2010, 500)]);
    }

    #[test]
    fn io_management() {
        let c = ruh_status(1, 16).unwrap();
        assert_eq!((c.opcode, c.nsid, c.cdw10, c.cdw11, c.data_len), (0x12, 1, 1, 3, 16));
        let c = ruh_status(1, 16 + 8 * 32).unwrap();
        assert_eq!(c.cdw11, 271 / 4);
        assert_eq!(ruh_status(1, 0), Err(CmdError::Length(0)));
        assert_eq!(ruh_status(1, 18), Err(CmdError::Length(18)));
        let c = ruh_update(1, 3).unwrap();
        assert_eq!((c.opcode, c.cdw10, c.data_len), (0x1D, 1 | (2 << 16), 6));
        assert_eq!(encode_pids(&[1, 0x0203]), vec![1, 0, 3, 2]);
        assert_eq!(ruh_update(1, 0), Err(CmdError::PidCount(0)));
    }

    #[test]
    fn admin_commands() {
        // nvme get-log /dev/nvme0 --log-id=0x20 --log-len=4096 --lsi=1 encodes this.
        let c = get_log_page(0, lid::FDP_CONFIGS, 0, 1, 0, 4096).unwrap();
        let b = c.to_bytes();
        assert_eq!(b[0], 0x02);
        assert_eq!(dw(&b, 40), 0x20 | (1023 << 16));
        assert_eq!(dw(&b, 44), 1 << 16);
        assert_eq!((dw(&b, 48), dw(&b, 52), dw(&b, 36)), (0, 0, 4096));
        // Host events: LSP bit 0; a long log splits NUMD over NUMDL/NUMDU; offsets.
        let c = get_log_page(0, lid::FDP_EVENTS, 1, 0xabcd, 0x1_0000_0008, 0x40_0000).unwrap();
        assert_eq!(c.cdw10, 0x23 | (1 << 8) | (0xffff << 16));
        assert_eq!(c.cdw11, 0xf | (0xabcd << 16)); // 4 MiB = 0x10_0000 dwords, NUMD 0xf_ffff
        assert_eq!((c.cdw12, c.cdw13), (8, 1));
        assert_eq!(get_log_page(0, 0x22, 0, 1, 0, 0), Err(CmdError::Length(0)));
        assert_eq!(get_log_page(0, 0x22, 0, 1, 2, 64), Err(CmdError::Length(2)));
        let c = identify(cns::CONTROLLER, 0);
        assert_eq!((c.opcode, c.cdw10, c.data_len, c.nsid), (0x06, 1, 4096, 0));
        let c = identify(cns::NAMESPACE, 1);
        assert_eq!((c.cdw10, c.nsid), (0, 1));
        // nvme get-feature /dev/nvme0 -f 0x1d --cdw11=1
        let c = get_features(fid::FDP, 0, 1);
        assert_eq!((c.opcode, c.cdw10, c.cdw11, c.data_len), (0x0A, 0x1D, 1, 0));
        assert_eq!(get_features(fid::FDP, 3, 1).cdw10, 0x31D);
    }

    #[test]
    fn status_decoding() {
        let s = NvmeStatus(0x400f);
        assert!(s.dnr());
        assert_eq!((s.sct(), s.sc(), s.code()), (0, 0x0f, 0x0f));
        assert_eq!(s.to_string(), "NVMe status 0x400f: Data SGL Length Invalid");
        assert_eq!(NvmeStatus(0x4002).name(), "Invalid Field in Command");
        assert_eq!(NvmeStatus(0x0109).name(), "Invalid Log Page");
        assert!(NvmeStatus(0x07ff).to_string().contains("type 7"));
    }
}
